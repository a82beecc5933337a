"""`FlatTransport`: one uneven all-to-all over all ranks per direction, the baseline and the
oracle of the other transports."""

from __future__ import annotations

import functools
import math
import time

import torch

from splitmoe.comm.handles import UNKNOWN_LAYER, DispatchHandle, ExpertBatch
from splitmoe.comm.shm_lane import ShmLane
from splitmoe.comm.topology import Topology
from splitmoe.comm.transport import Transport


class FlatTransport(Transport):
    """One uneven all-to-all over all ranks per direction; the expert ranks learn their row
    counts with the rows (`all_to_all_counted`: frames that carry their size over shared memory,
    a count exchange first over torch.distributed)."""

    name = "flat"

    def __init__(self, topo: Topology, *args, **kwargs):
        super().__init__(topo, *args, **kwargs)  # same arguments as every transport
        self._attention_ranks = list(range(topo.num_attention))
        # Where the lanes are shared memory, the partial sums go from expert to attention ranks
        # as frames straight on the rings (`send_back`, `combine`), without the general
        # collective's bookkeeping (tens of microseconds a layer on either side, paid once per
        # micro-batch).
        self._frames: ShmLane | None = None
        lanes = (self.lanes["dispatch"], self.lanes["combine"])
        if self.device.type == "cpu" and all(isinstance(lane, ShmLane) for lane in lanes):
            self._frames = lanes[1]  # (expert ranks send their partial sums on it: `send_back`)

    def _dispatch_rows(self, rows: torch.Tensor, counts: list[int], layer: int):
        rows = rows.to(self.comm_device)
        t0 = time.perf_counter()
        out = self.lanes["dispatch"].all_to_all_counted(rows, counts, self._attention_ranks)
        self.stats.add_seconds(layer, "exchange", time.perf_counter() - t0)
        self._account(layer, "dispatch", counts, rows)
        return out

    def dispatch(self, x, topk_ids, topk_weights, layer=UNKNOWN_LAYER):
        self.stats.call(layer, "flat")
        token_index, rows, counts = self.route_rows(x, topk_ids, topk_weights)  # [P, row_bytes]

        def send() -> None:
            self._dispatch_rows(rows, counts, layer)

        sent = self.post("dispatch", send, sends=True, inputs=(rows,))
        return DispatchHandle(
            token_index=token_index,
            send_counts=counts,
            num_tokens=x.shape[0],
            layer=layer,
            sent=sent,
        )

    def combine(self, handle):
        got = self.post("combine", functools.partial(self._partial_sums, handle), sends=False)
        partial = got.wait()  # [P, H]
        handle.sent.wait()  # (done by now: raises what the dispatch raised)
        if partial.shape[0] == handle.num_tokens and max(handle.send_counts) == partial.shape[0]:
            # every token went to one expert rank, the same one (1+1, or all routed to one
            # rank): its rows are each token's sum already, in token order
            return partial
        out = torch.zeros(handle.num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        out.index_add_(0, handle.token_index, partial)
        return out

    def _partial_sums(self, handle: DispatchHandle) -> torch.Tensor:
        """The partial sums of a dispatched layer, ``[P, H]`` in its rows' order."""
        if self._frames is not None:  # each expert rank's frame straight off its ring
            partial = torch.empty(len(handle.token_index), self.hidden_size, dtype=self.dtype)
            self._frame_rows(self._frames.recv_frame, partial, handle.send_counts, handle.layer)
            return partial
        return self.all_to_all(
            self._no_sums, self._zeros, handle.send_counts, handle.layer, "combine"
        )

    def send_back(self, y, batch):
        if self._frames is None:
            return super().send_back(y, batch)
        y = y.contiguous()
        counts = batch.recv_counts

        def send() -> None:
            self._frame_rows(self._frames.send_frame, y, counts, batch.layer)
            self._account(batch.layer, "combine", counts, y)

        self._sends.append(self.post("combine", send, sends=True))

    def _frame_rows(self, move, rows: torch.Tensor, counts: list[int], layer: int) -> None:
        """``move(j, rows, byte offset, byte size)`` for each member j's ``counts[j]`` rows of
        ``rows [N, ...]`` (contiguous, in member order; none for zero counts), timed as the
        layer's exchange."""
        rb, at = math.prod(rows.shape[1:]) * rows.element_size(), 0
        t0 = time.perf_counter()
        for j, n in enumerate(counts):
            if n:
                move(j, rows, at * rb, n * rb)
                at += n
        self.stats.add_seconds(layer, "exchange", time.perf_counter() - t0)

    def receive(self, layer=UNKNOWN_LAYER):
        self.stats.call(layer, "flat")

        def receive() -> tuple[torch.Tensor, list[int], None]:
            rows, recv_counts = self._dispatch_rows(self._no_rows, self._zeros, layer)
            return rows.to(self.device), recv_counts, None

        return ExpertBatch(self.post("dispatch", receive, sends=False), self.unpack, layer)
