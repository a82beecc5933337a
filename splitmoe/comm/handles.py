"""What a transport hands its callers for one layer: `DispatchHandle` on an attention rank
(between `Transport.dispatch` and `Transport.combine`) and `ExpertBatch` on an expert rank
(between `Transport.receive` and `Transport.send_back`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from splitmoe.comm.transfer import Transfer

UNKNOWN_LAYER = -1  # calls that did not say which layer they serve


@dataclass
class DispatchHandle:
    """What an attention rank keeps between `dispatch` and `combine` of one layer.

    token_index: ``[P]`` int64, the source token of each sent row (rows are grouped by
        destination rank, in rank order, tokens ascending within a destination).
    send_counts: rows sent to each world rank (zero for attention ranks); the partial sums come
        back with the same counts.
    num_tokens: ``T``, tokens of this rank in the layer.
    layer: the MoE layer (for the statistics; `UNKNOWN_LAYER` if the caller did not say).
    sent: the posted dispatch (`Transfer`); its value is the transport-specific layout of the
        layer (`splitmoe.comm.two_phase.LayerPlan` for the two-phase and adaptive transports;
        None for flat). `combine` waits for it.
    """

    token_index: torch.Tensor
    send_counts: list[int]
    num_tokens: int
    layer: int = UNKNOWN_LAYER
    sent: Transfer | None = None

    def done(self) -> bool:
        """Whether the dispatch has completed: the expert ranks have received its rows."""
        return self.sent is None or self.sent.done()

    @property
    def plan(self) -> Any:
        """The layer's layout (waits for the dispatch)."""
        return None if self.sent is None else self.sent.wait()


class ExpertBatch:
    """Tokens an expert rank receives for one layer, as posted by `Transport.receive`.

    ``received``: the posted receive; its value is ``(rows, recv_counts, plan)``. Every property
    waits for it (`wait` does so explicitly, to time the wait):
    rows: ``[N, row_bytes]`` uint8, the packed rows as they came (`Transport.pack`);
    recv_counts: rows received from each world rank (the partial sums go back with these);
    x: ``[N, H]`` hidden states, expert_ids: ``[N, k]`` int32 *local* expert ids (-1 where the
        slot is served by another rank), weights: ``[N, k]`` float32 router weights, unpacked on
        first use by ``unpack`` (the transport's `Transport.unpack`).
    Rows are in the same order whichever transport carried them: by source attention rank, then
    as that rank sent them. ``layer``: as in `DispatchHandle`; plan: the transport's layout.
    """

    def __init__(
        self,
        received: Transfer,
        unpack: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        layer: int = UNKNOWN_LAYER,
    ):
        self.received = received
        self.unpack = unpack
        self.layer = layer

    def wait(self) -> ExpertBatch:
        self.received.wait()
        return self

    def done(self) -> bool:
        return self.received.done()

    @property
    def rows(self) -> torch.Tensor:
        return self.received.wait()[0]

    @property
    def recv_counts(self) -> list[int]:
        return self.received.wait()[1]

    @property
    def plan(self) -> Any:
        return self.received.wait()[2]

    @functools.cached_property
    def _parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.unpack(self.rows)

    @property
    def x(self) -> torch.Tensor:
        return self._parts[0]

    @property
    def expert_ids(self) -> torch.Tensor:
        return self._parts[1]

    @property
    def weights(self) -> torch.Tensor:
        return self._parts[2]
