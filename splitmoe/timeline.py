"""Per-rank timelines: what each rank did when, for the last few steps.

Spans are ``(step, name, kind, start, end)`` with ``kind`` one of ``compute`` (model or expert
math), ``comm`` (posting or copying messages) and ``wait`` (blocked on a peer or the control
plane). Clocks are `time.perf_counter` (system-wide monotonic on Linux, so ranks of one machine
line up). Recording is a tuple append per span: cheap enough to stay on.

Each rank also sums its own time per kind as spans close (`Timeline.take_times`): what it shares
in the control exchange for the micro-batch count (`splitmoe.scheduler.micro_batches`). A span
nested in another counts for its own kind, and only its self time counts for the outer one (the
attention forward encloses the dispatches and combines it makes), as in `breakdown`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

KINDS = ("compute", "comm", "wait")


@dataclass(frozen=True)
class StepTimes:
    """Seconds one rank spent per kind in one step (self time: nested spans counted once)."""

    compute: float = 0.0
    comm: float = 0.0
    wait: float = 0.0

    @property
    def busy(self) -> float:
        """Time this rank's own thread was occupied: computing or posting messages."""
        return self.compute + self.comm

    @property
    def total(self) -> float:
        return self.compute + self.comm + self.wait


@dataclass(frozen=True)
class Span:
    step: int
    name: str
    kind: str
    start: float
    end: float


class Timeline:
    def __init__(self, max_spans: int = 20000):
        self.spans: deque[tuple] = deque(maxlen=max_spans)
        self.step = 0
        self._totals = dict.fromkeys(KINDS, 0.0)  # self time per kind since `take_times`
        self._open: list[float] = []  # per open span: the time of its closed children

    def span(self, name: str, kind: str) -> _Timed:
        """``with timeline.span(name, kind): ...`` records the block's span (also when it
        raises)."""
        return _Timed(self, name, kind)

    def export(self) -> list[Span]:
        return [Span(*s) for s in self.spans]

    def take_times(self) -> StepTimes:
        """Self time per kind of the spans closed since the last call; starts a new sum."""
        t = self._totals
        out = StepTimes(t["compute"], t["comm"], t["wait"])
        self._totals = dict.fromkeys(KINDS, 0.0)
        return out


class _Timed:
    """`Timeline.span`'s context manager: a plain class, as a span opens several times per layer
    and micro-batch on every rank (a ``@contextmanager`` generator costs several times as much
    to enter and leave)."""

    __slots__ = ("_timeline", "_name", "_kind", "_start")

    def __init__(self, timeline: Timeline, name: str, kind: str):
        self._timeline, self._name, self._kind = timeline, name, kind

    def __enter__(self) -> None:
        self._timeline._open.append(0.0)
        self._start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        end = time.perf_counter()
        tl = self._timeline
        tl.spans.append((tl.step, self._name, self._kind, self._start, end))
        open_ = tl._open
        took = end - self._start
        tl._totals[self._kind] += took - open_.pop()
        if open_:
            open_[-1] += took


def breakdown(spans: list[Span]) -> dict[str, float]:
    """Seconds per kind over the given spans, plus ``other`` (Python and framework time between
    spans) against the wall time from the first start to the last end."""
    if not spans:
        return {k: 0.0 for k in (*KINDS, "other", "wall")}
    out = {k: 0.0 for k in KINDS}
    for s in spans:
        out[s.kind] += s.end - s.start
    # a compute span (the attention forward) encloses the dispatches and combines it makes:
    # count their time once, as comm / wait
    for outer in spans:
        if outer.kind != "compute":
            continue
        for inner in spans:
            if inner is not outer and outer.start <= inner.start and inner.end <= outer.end:
                out["compute"] -= inner.end - inner.start
    wall = max(s.end for s in spans) - min(s.start for s in spans)
    out["other"] = max(0.0, wall - sum(out[k] for k in KINDS))
    out["wall"] = wall
    return out


def chrome_trace(spans_by_rank: dict[int, list[Span]], roles: dict[int, str]) -> dict:
    """Chrome-trace / Perfetto JSON: one process per rank, one thread per kind."""
    events = []
    t0 = min((s.start for spans in spans_by_rank.values() for s in spans), default=0.0)
    for rank, spans in spans_by_rank.items():
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": rank,
                "args": {"name": f"rank {rank} ({roles.get(rank, '?')})"},
            }
        )
        for tid, kind in enumerate(KINDS):
            events.append(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": kind}}
            )
        for s in spans:
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "cat": s.kind,
                    "pid": rank,
                    "tid": KINDS.index(s.kind),
                    "ts": (s.start - t0) * 1e6,
                    "dur": (s.end - s.start) * 1e6,
                    "args": {"step": s.step},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
