"""`CommStats`: what a rank's transport sent and how long it waited, per MoE layer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from splitmoe.comm.cost_model import LINK_CLASSES

DIRECTIONS = ("dispatch", "combine")  # attention -> experts / experts -> attention
# Where a layer's communication time goes: the two-phase scheme's per-layer count all-gather,
# its node-local aggregation (phase 1, both directions), and the exchange with the expert ranks
# (flat's all-to-all, its row counts included, or phase 2).
STAGES = ("counts", "aggregate", "exchange")
SCHEMES = ("flat", "two_phase")


def _empty_record() -> dict:
    return {
        "calls": 0,
        "schemes": dict.fromkeys(SCHEMES, 0),
        **{d: {c: {"messages": 0, "bytes": 0} for c in LINK_CLASSES} for d in DIRECTIONS},
        "seconds": dict.fromkeys(STAGES, 0.0),
        "predicted_s": dict.fromkeys(SCHEMES, 0.0),
    }


def _add_records(into: dict, rec: dict) -> None:
    for key, value in rec.items():
        if isinstance(value, dict):
            _add_records(into[key], value)
        else:
            into[key] += value


class CommStats:
    """What this rank's transport sent and how long it waited, cumulative since start.

    Kept per MoE layer; within a layer: ``calls`` (dispatch or receive calls, i.e. steps that ran
    the layer), ``schemes`` (calls that used each scheme), per direction and link class the
    messages (non-empty transfers to *another* rank; self-copies are free) and bytes this rank
    sent, ``seconds`` per stage (host wall-clock around each collective; on CUDA it includes the
    count synchronisation but not the asynchronous data copies) and, for the adaptive transport,
    ``predicted_s`` the cost model's per-layer time of each scheme summed over calls.
    """

    def __init__(self) -> None:
        self.layers: dict[int, dict] = {}
        # The communication threads (`Transfer`) record too: a record is created, a time added
        # and the records read under this lock; the message and byte counts of a direction are
        # only ever added by one thread.
        self._lock = threading.Lock()

    def record(self, layer: int) -> dict:
        rec = self.layers.get(layer)
        if rec is None:
            with self._lock:
                rec = self.layers.setdefault(layer, _empty_record())
        return rec

    def add_seconds(self, layer: int, stage: str, seconds: float) -> None:
        rec = self.record(layer)
        with self._lock:
            rec["seconds"][stage] += seconds

    def call(self, layer: int, scheme: str) -> None:
        rec = self.record(layer)
        rec["calls"] += 1
        rec["schemes"][scheme] += 1

    def add(
        self,
        layer: int,
        direction: str,
        counts: list[int],
        row_bytes: int,
        peers: list[int] | range,
        links: list[str],
        rank: int,
    ) -> None:
        """``counts[i]`` rows of ``row_bytes`` sent to world rank ``peers[i]``; ``links[r]`` is
        the link class to world rank ``r``."""
        rec = self.record(layer)[direction]
        for peer, n in zip(peers, counts):
            if n and peer != rank:
                cls = rec[links[peer]]
                cls["messages"] += 1
                cls["bytes"] += n * row_bytes

    @contextmanager
    def timed(self, layer: int, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add_seconds(layer, stage, time.perf_counter() - t0)

    def total(self) -> dict:
        out = _empty_record()
        with self._lock:
            for rec in self.layers.values():
                _add_records(out, rec)
        return out

    @property
    def messages(self) -> int:
        t = self.total()
        return sum(t[d][c]["messages"] for d in DIRECTIONS for c in LINK_CLASSES)

    @property
    def bytes(self) -> int:
        t = self.total()
        return sum(t[d][c]["bytes"] for d in DIRECTIONS for c in LINK_CLASSES)

    def snapshot(self) -> dict:
        """``{"layers": {"<layer>": record}, "total": record}`` (see the class doc), JSON-ready."""
        with self._lock:
            layers = {str(k): _copy(v) for k, v in sorted(self.layers.items())}
        return {"layers": layers, "total": self.total()}


def _copy(rec: dict) -> dict:
    return {k: _copy(v) if isinstance(v, dict) else v for k, v in rec.items()}
