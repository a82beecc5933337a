"""Dispatch and combine between attention ranks and expert ranks.

Every MoE layer, each attention rank sends each of its tokens **once per distinct destination
expert rank**, together with the (local expert id, router weight) pairs that rank must apply; each
expert rank returns one weighted partial sum per token; the attention rank adds them.
Bytes per layer are therefore ~ tokens x hidden x distinct destinations, not tokens x top-k.

All ranks call the same collectives in the same order (attention ranks with zero tokens too), so
the pattern never deadlocks. A token travels as one packed byte row: its hidden vector in the model
dtype, then ``k`` int32 local expert ids (-1: served elsewhere) and ``k`` float32 weights, so one
message per (source, destination) carries everything.

This module holds `Transport`, the interface every transport implements, with what they share:
routing, packing and the all-to-all of the data plane. `FlatTransport` (`splitmoe.comm.flat`,
one all-to-all per direction) is the baseline and the oracle; the two-phase and adaptive
transports live in `splitmoe.comm.two_phase`; `splitmoe.comm.transports` names them all. The
handles a call returns are in `splitmoe.comm.handles`, how its transfers are posted and waited
for in `splitmoe.comm.transfer`. Each transport accounts its traffic the same way in `CommStats`
(`splitmoe.comm.stats`).
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from splitmoe.comm.cost_model import DEFAULT_COST_MODEL, CostModel
from splitmoe.comm.distributed import Collective, new_collective
from splitmoe.comm.handles import UNKNOWN_LAYER, DispatchHandle, ExpertBatch
from splitmoe.comm.shm import ShmHub
from splitmoe.comm.stats import DIRECTIONS, CommStats
from splitmoe.comm.topology import Topology
from splitmoe.comm.transfer import Poster, Transfer, new_poster


class Transport(ABC):
    """Moves tokens attention -> experts and partial sums back, for one layer at a time.

    Attention ranks call `dispatch` then `combine`; expert ranks call `receive` then `send_back`.
    The calls of all ranks for one layer form one collective pattern. ``layer`` (optional) only
    labels the statistics.

    Nothing blocks where it is posted: `dispatch` returns a `DispatchHandle` once its transfers
    are posted, `receive` an `ExpertBatch` whose data is waited for on first use, `send_back`
    returns at once (`flush` waits for the sends); `combine` is where an attention rank waits,
    for the partial sums it returns. Each direction's transfers run in posting order on its
    own lane (`Transfer` says how), so micro-batches interleave freely between the directions.
    """

    name = "base"

    def __init__(
        self,
        topo: Topology,
        group: dist.ProcessGroup,
        comm_device: torch.device,
        hidden_size: int,
        top_k: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        cost_model: CostModel | None = None,
        timeout: timedelta | None = None,
        hub: ShmHub | None = None,
    ):
        """Every transport takes the same arguments. ``cost_model``: link profile for transports
        that choose a scheme per layer (default: NVLink 4 + 400 Gb/s InfiniBand); ``timeout``: for
        process groups a transport creates (default: torch's); ``hub``: carries the collectives
        of ranks that share a host over shared memory (`splitmoe.comm.shm`), instead of
        ``torch.distributed``."""
        self.topo = topo
        self.group = group
        self.comm_device = comm_device
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.dtype = dtype
        self.device = device
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.row_bytes = hidden_size * self.elem + 8 * top_k
        # Routing is by expert *slot* (see `Topology`): the attention side's balancer maps each
        # (token, expert) to a slot holding that expert; without replicas slot id = expert id.
        owner = torch.tensor(topo.slot_owner, dtype=torch.int64, device=device)
        first = torch.cumsum(torch.bincount(owner, minlength=topo.num_expert), 0)
        self.slot_rank = owner  # [S] slot -> expert-rank index
        self.slot_local = (
            torch.arange(owner.numel(), device=device)
            - (first - torch.bincount(owner, minlength=topo.num_expert))[owner]
        )  # [S] slot -> local slot id on its rank
        self._slot_rank_np = self.slot_rank.cpu().numpy()
        self._slot_local_np = self.slot_local.cpu().numpy()
        # link class from this rank to every world rank
        self.links = [
            "intra" if topo.node_of(r) == topo.node else "inter" for r in range(topo.world_size)
        ]
        self.stats = CommStats()
        self.cost_model = cost_model or DEFAULT_COST_MODEL
        self.timeout = timeout
        self.hub = hub
        # One group per direction ("lane"): with micro-batches, dispatches of later micro-batches
        # and combines of earlier ones interleave differently on attention and expert ranks, and
        # collectives on one group must be issued in the same order everywhere. Each lane on its
        # own is in the same (layer, micro-batch) order on every rank.
        # Each lane has a process group of its own: its collectives run on a communication
        # thread (`Transfer`), never interleaved with the control plane's on ``group``.
        world = range(topo.world_size)
        self.lanes: dict[str, Collective] = {
            "dispatch": self.new_lane(world),
            "combine": self.new_lane(world),
        }
        # inline over shared memory, else on a communication thread (`new_poster` says why)
        self.posters: dict[str, Poster] = {
            d: new_poster(d, self.lanes[d], self.hub is not None, comm_device) for d in DIRECTIONS
        }
        self._sends: list[Transfer] = []  # `send_back`s not yet waited for (`flush`)
        # what the receiving side of an all-to-all sends: made once, not per layer and
        # micro-batch
        self._zeros = [0] * topo.world_size
        self._no_rows = torch.empty(0, self.row_bytes, dtype=torch.uint8, device=comm_device)
        self._no_sums = torch.empty(0, hidden_size, dtype=dtype)

    def post(
        self, direction: str, fn: Callable[[], Any], sends: bool, inputs: tuple = ()
    ) -> Transfer:
        """Posts ``fn`` (the collectives of one call, in the order every rank runs them) on
        ``direction``'s lane. ``sends``: it only sends (over shared memory it then runs at
        once); ``inputs``: tensors it reads (on CUDA, kept alive for the lane's stream)."""
        return self.posters[direction].post(fn, sends, inputs)

    def close(self) -> None:
        """Stops the communication threads (idle ones: after `flush` and the last `combine`)."""
        for poster in self.posters.values():
            poster.close()

    def new_lane(
        self, ranks: range | list[int], group: dist.ProcessGroup | None = None
    ) -> Collective | None:
        """The collective of ``ranks`` (None on non-members); every world rank calls it, in the
        same order."""
        timeout = self.timeout or dist.default_pg_timeout
        return new_collective(ranks, self.hub, timeout, group=group)

    @abstractmethod
    def dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layer: int = UNKNOWN_LAYER,
    ) -> DispatchHandle:
        """Posts ``x [T, H]`` routed by ``topk_ids / topk_weights [T, k]`` to the expert ranks
        (``topk_ids``: expert *slots*, see `route`) and returns without waiting for them: the
        handle's `DispatchHandle.done` says when they have received."""

    @abstractmethod
    def combine(self, handle: DispatchHandle) -> torch.Tensor:
        """Waits for a dispatched layer's partial sums; returns ``[T, H]`` in the model dtype."""

    @abstractmethod
    def receive(self, layer: int = UNKNOWN_LAYER) -> ExpertBatch:
        """Expert side of `dispatch`: posts the receive of the layer's next micro-batch and
        returns its `ExpertBatch` at once; its data is waited for on first use. Receives run
        in posting order, so a rank may post the next one before it computes this one."""

    def send_back(self, y: torch.Tensor, batch: ExpertBatch) -> None:
        """Expert side of `combine`: ``y [N, H]`` partial sums, one per received row, back to
        the ranks they came from (every transport's last hop is this one all-to-all). Returns
        before the transfer completes, so the expert rank can receive the next micro-batch;
        `flush` waits for all of them."""
        counts = batch.recv_counts
        self._sends.append(
            self.post(
                "combine",
                lambda: self.all_to_all(y, counts, self._zeros, batch.layer, "combine"),
                sends=True,
                inputs=(y,),
            )
        )

    def stats_snapshot(self) -> dict:
        """This rank's cumulative statistics, JSON-serialisable::

            {"rank": int, "role": "attention" | "expert", "node": int, "transport": str,
             "layers": {"<layer>": record, ...}, "total": record}

        record = {"calls": int, "schemes": {"flat": int, "two_phase": int},
                  "dispatch": {"intra": {"messages": int, "bytes": int}, "inter": {...}},
                  "combine":  {"intra": {...}, "inter": {...}},
                  "seconds": {"counts": float, "aggregate": float, "exchange": float},
                  "predicted_s": {"flat": float, "two_phase": float}}

        Messages and bytes are what *this* rank sent (summing over ranks counts each transfer
        once); layer ``"-1"`` collects calls that did not name their layer.
        """
        return {
            "rank": self.topo.rank,
            "role": self.topo.role,
            "node": self.topo.node,
            "transport": self.name,
            **self.stats.snapshot(),
        }

    # ---- packing ------------------------------------------------------------------------------
    def pack(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x [P, H]``, ``ids [P, k]`` int32, ``w [P, k]`` float32 -> ``[P, row_bytes]`` uint8."""
        return torch.cat(
            [x.contiguous().view(torch.uint8), ids.view(torch.uint8), w.view(torch.uint8)], dim=1
        )

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`pack`'s inverse: ``x [N, H]``, ``ids [N, k]`` int32, ``w [N, k]`` float32. On CPU
        they are views into ``rows`` (row stride ``row_bytes``; three copies would cost as much
        as the rest of receiving a message), on other devices contiguous copies."""
        hb, k = self.hidden_size * self.elem, self.top_k
        if rows.device.type == "cpu" and self.row_bytes % 4 == 0 and hb % 4 == 0:
            words = rows.view(torch.int32)  # [N, row_bytes / 4]
            at = hb // 4
            x = rows[:, :hb].view(self.dtype)
            return x, words[:, at : at + k], words[:, at + k :].view(torch.float32)
        x = rows[:, :hb].contiguous().view(self.dtype)  # [N, H]
        ids = rows[:, hb : hb + 4 * k].contiguous().view(torch.int32)  # [N, k]
        w = rows[:, hb + 4 * k :].contiguous().view(torch.float32)  # [N, k]
        return x, ids, w

    def route(
        self, slots: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """One row per (token, distinct destination rank), grouped by destination.

        ``slots [T, k]``: the expert slot serving each (token, expert) (the balancer's choice;
        expert ids when there are no replicas). Returns ``token_index [P]``, local slot ids
        ``[P, k]`` int32 (-1 off-rank), weights ``[P, k]`` float32 and the row count per world
        rank.
        """
        if slots.device.type == "cpu":
            return self._route_numpy(slots, topk_weights)
        return self._route_torch(slots, topk_weights)

    def route_rows(
        self, x: torch.Tensor, slots: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """`route` and `pack`: ``token_index [P]``, the packed rows ``[P, row_bytes]`` grouped
        by destination, and the row count per world rank."""
        token_index, ids, w, counts = self.route(slots, topk_weights)
        return token_index, self.pack(x[token_index], ids, w), counts

    def _route_torch(
        self, slots: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """`route` in torch ops (any device, no loop)."""
        T, E = slots.shape[0], self.topo.num_expert
        dest = self.slot_rank[slots]  # [T, k]
        hit = torch.zeros(E, T, dtype=torch.bool, device=slots.device)
        hit.scatter_(0, dest.t(), True)  # [E, T]
        dest_rank, token_index = hit.nonzero(as_tuple=True)  # [P], sorted by (dest, token)
        on_rank = dest[token_index] == dest_rank[:, None]  # [P, k]
        ids = torch.where(on_rank, self.slot_local[slots[token_index]], -1).to(torch.int32)
        w = topk_weights[token_index].to(torch.float32)
        per_expert_rank = torch.bincount(dest_rank, minlength=E).tolist()
        counts = [0] * self.topo.num_attention + per_expert_rank
        return token_index, ids, w, counts

    def _route_numpy(
        self, slots: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """`route` on CPU tensors, the same steps in numpy: on arrays this small a call's fixed
        cost dominates, numpy's is a fraction of torch's, and routing runs once per layer and
        micro-batch."""
        s = slots.numpy()
        T, E = s.shape[0], self.topo.num_expert
        dest = self._slot_rank_np[s]  # [T, k]
        hit = np.zeros((E, T), dtype=bool)
        hit[dest, np.arange(T)[:, None]] = True  # [E, T]
        dest_rank, token_index = np.nonzero(hit)  # [P], sorted by (dest, token)
        on_rank = dest[token_index] == dest_rank[:, None]  # [P, k]
        ids = np.where(on_rank, self._slot_local_np[s[token_index]], -1).astype(np.int32)
        tokens = torch.from_numpy(token_index)
        w = topk_weights.to(torch.float32).index_select(0, tokens)
        counts = [0] * self.topo.num_attention + np.bincount(dest_rank, minlength=E).tolist()
        # (via 1-D: numpy may give an empty [0, k] array strides torch cannot view as bytes)
        return tokens, torch.from_numpy(ids.ravel()).view(-1, s.shape[1]), w, counts

    # ---- data plane ---------------------------------------------------------------------------
    def all_to_all(
        self,
        send: torch.Tensor,
        send_counts: list[int],
        recv_counts: list[int],
        layer: int,
        direction: str,
        stage: str = "exchange",
        group: Collective | None = None,
        peers: list[int] | range | None = None,
    ) -> torch.Tensor:
        """Uneven ``all_to_all_single`` of rows over ``group`` (default: the lane of
        ``direction``, whose members are all world ranks); ``peers[i]`` is the world rank of
        member ``i``. Blocking (call it inside a posted function, `post`); counts the transfer
        in `stats` and returns the received rows on the compute device."""
        send = send.to(self.comm_device)
        recv = torch.empty(
            (sum(recv_counts), *send.shape[1:]), dtype=send.dtype, device=self.comm_device
        )
        lane = self.lanes[direction] if group is None else group
        t0 = time.perf_counter()  # (not `stats.timed`: a generator per call on the hot path)
        lane.all_to_all_single(recv, send, recv_counts, send_counts)
        self.stats.add_seconds(layer, stage, time.perf_counter() - t0)
        self._account(layer, direction, send_counts, send, peers)
        return recv.to(self.device)

    def _account(
        self,
        layer: int,
        direction: str,
        send_counts: list[int],
        send: torch.Tensor,
        peers: list[int] | range | None = None,
    ) -> None:
        """Counts ``send_counts`` rows of ``send`` to each member (world ranks ``peers``)."""
        self.stats.add(
            layer,
            direction,
            send_counts,
            math.prod(send.shape[1:]) * send.element_size(),
            range(self.topo.world_size) if peers is None else peers,
            self.links,
            self.topo.rank,
        )

    def flush(self) -> None:
        """Waits until every `send_back` has completed (expert ranks, end of a step)."""
        sends, self._sends = self._sends, []
        for t in sends:
            t.wait()
