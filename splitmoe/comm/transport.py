"""Dispatch and combine between attention ranks and expert ranks.

Every MoE layer, each attention rank sends each of its tokens **once per distinct destination
expert rank**, together with the (local expert id, router weight) pairs that rank must apply; each
expert rank returns one weighted partial sum per received token; the attention rank adds them.
Bytes per layer are therefore ~ tokens x hidden x distinct destinations, not tokens x top-k.

All ranks call the same collectives in the same order (attention ranks with zero tokens too), so
the pattern never deadlocks. A token travels as one packed byte row: its hidden vector in the model
dtype, then ``k`` int32 local expert ids (-1: served elsewhere) and ``k`` float32 weights, so one
message per (source, destination) carries everything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

from splitmoe.comm.topology import Topology


@dataclass
class DispatchHandle:
    """What an attention rank keeps between `dispatch` and `combine` of one layer.

    token_index: ``[P]`` int64, the source token of each sent row (rows are grouped by
        destination rank, in rank order, tokens ascending within a destination).
    send_counts: rows sent to each world rank (zero for attention ranks); the partial sums come
        back with the same counts.
    num_tokens: ``T``, tokens of this rank in the layer.
    """

    token_index: torch.Tensor
    send_counts: list[int]
    num_tokens: int


@dataclass
class ExpertBatch:
    """Tokens an expert rank received for one layer.

    x: ``[N, H]`` hidden states; expert_ids: ``[N, k]`` int32 *local* expert ids, -1 where the
    slot is served by another rank; weights: ``[N, k]`` float32 router weights;
    recv_counts: rows received from each world rank (the partial sums go back with these).
    """

    x: torch.Tensor
    expert_ids: torch.Tensor
    weights: torch.Tensor
    recv_counts: list[int]


@dataclass
class CommStats:
    """Messages (non-empty peer transfers) and bytes this rank sent, since start."""

    messages: int = 0
    bytes: int = 0

    def add(self, counts: list[int], row_bytes: int, rank: int) -> None:
        self.messages += sum(1 for r, c in enumerate(counts) if c and r != rank)
        self.bytes += sum(c for r, c in enumerate(counts) if r != rank) * row_bytes


class Transport(ABC):
    """Moves tokens attention -> experts and partial sums back, for one layer at a time.

    Attention ranks call `dispatch` then `combine`; expert ranks call `receive` then `send_back`.
    The calls of all ranks for one layer form one collective pattern.
    """

    def __init__(
        self,
        topo: Topology,
        group: dist.ProcessGroup,
        comm_device: torch.device,
        hidden_size: int,
        top_k: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.topo = topo
        self.group = group
        self.comm_device = comm_device
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.dtype = dtype
        self.device = device
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.row_bytes = hidden_size * self.elem + 8 * top_k
        owner = torch.tensor(topo.expert_owner, dtype=torch.int64, device=device)
        local = torch.zeros_like(owner)
        for r in range(topo.num_expert):
            mine = (owner == r).nonzero().flatten()
            local[mine] = torch.arange(mine.numel(), device=device)
        self.owner_of = owner  # [num_experts] expert -> expert-rank index
        self.local_of = local  # [num_experts] expert -> local id on its rank
        self.stats = CommStats()

    @abstractmethod
    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchHandle:
        """Sends ``x [T, H]`` routed by ``topk_ids / topk_weights [T, k]`` to the expert ranks."""

    @abstractmethod
    def combine(self, handle: DispatchHandle) -> torch.Tensor:
        """Receives a dispatched layer's partial sums; returns ``[T, H]`` in the model dtype."""

    @abstractmethod
    def receive(self) -> ExpertBatch:
        """Expert side of `dispatch`."""

    @abstractmethod
    def send_back(self, y: torch.Tensor, batch: ExpertBatch) -> None:
        """Expert side of `combine`: ``y [N, H]`` partial sums, one per received row."""

    # ---- packing ------------------------------------------------------------------------------
    def pack(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x [P, H]``, ``ids [P, k]`` int32, ``w [P, k]`` float32 -> ``[P, row_bytes]`` uint8."""
        return torch.cat(
            [x.contiguous().view(torch.uint8), ids.view(torch.uint8), w.view(torch.uint8)], dim=1
        )

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hb, k = self.hidden_size * self.elem, self.top_k
        x = rows[:, :hb].contiguous().view(self.dtype)  # [N, H]
        ids = rows[:, hb : hb + 4 * k].contiguous().view(torch.int32)  # [N, k]
        w = rows[:, hb + 4 * k :].contiguous().view(torch.float32)  # [N, k]
        return x, ids, w

    def route(
        self, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """One row per (token, distinct destination rank), grouped by destination.

        Returns ``token_index [P]``, local ids ``[P, k]`` int32 (-1 off-rank), weights ``[P, k]``
        float32 and the row count per world rank.
        """
        T, E = topk_ids.shape[0], self.topo.num_expert
        dest = self.owner_of[topk_ids]  # [T, k]
        hit = torch.zeros(E, T, dtype=torch.bool, device=topk_ids.device)
        hit.scatter_(0, dest.t(), True)  # [E, T]
        dest_rank, token_index = hit.nonzero(as_tuple=True)  # [P], sorted by (dest, token)
        on_rank = dest[token_index] == dest_rank[:, None]  # [P, k]
        ids = torch.where(on_rank, self.local_of[topk_ids[token_index]], -1).to(torch.int32)
        w = topk_weights[token_index].to(torch.float32)
        per_expert_rank = torch.bincount(dest_rank, minlength=E).tolist()
        counts = [0] * self.topo.num_attention + per_expert_rank
        return token_index, ids, w, counts


class FlatTransport(Transport):
    """One uneven ``all_to_all_single`` over all ranks per direction, after a count exchange."""

    def _counts(self, send_counts: list[int]) -> list[int]:
        send = torch.tensor(send_counts, dtype=torch.int64, device=self.comm_device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.tolist()

    def _exchange(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        send = send.to(self.comm_device)
        recv = torch.empty(
            (sum(recv_counts), *send.shape[1:]), dtype=send.dtype, device=self.comm_device
        )
        dist.all_to_all_single(recv, send, recv_counts, send_counts, group=self.group)
        self.stats.add(
            send_counts,
            send[0].numel() * send.element_size() if send.numel() else 0,
            self.topo.rank,
        )
        return recv.to(self.device)

    def dispatch(self, x, topk_ids, topk_weights):
        token_index, ids, w, counts = self.route(topk_ids, topk_weights)
        rows = self.pack(x[token_index], ids, w)  # [P, row_bytes]
        self._exchange(rows, counts, self._counts(counts))
        return DispatchHandle(token_index=token_index, send_counts=counts, num_tokens=x.shape[0])

    def combine(self, handle):
        nothing = torch.empty(0, self.hidden_size, dtype=self.dtype)
        partial = self._exchange(nothing, [0] * self.topo.world_size, handle.send_counts)
        out = torch.zeros(handle.num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        out.index_add_(0, handle.token_index, partial)
        return out

    def receive(self):
        zeros = [0] * self.topo.world_size
        recv_counts = self._counts(zeros)
        rows = self._exchange(torch.empty(0, self.row_bytes, dtype=torch.uint8), zeros, recv_counts)
        x, ids, w = self.unpack(rows)
        return ExpertBatch(x=x, expert_ids=ids, weights=w, recv_counts=recv_counts)

    def send_back(self, y, batch):
        self._exchange(y, batch.recv_counts, [0] * self.topo.world_size)


TRANSPORTS: dict[str, type[Transport]] = {"flat": FlatTransport}
