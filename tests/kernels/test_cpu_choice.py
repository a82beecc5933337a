"""The CPU kernel chooser (`splitmoe.kernels.cpu_choice`) on a fake clock: it keeps the fastest
candidate, times each shape class only until decided, persists its decisions, survives a broken
cache file, and keys them by everything a kernel's speed depends on; classes are settled before
serving, within a time budget, and serving never times a candidate. And no kernel choice in
`splitmoe/` is a constant again."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from splitmoe.kernels.cpu_choice import (
    ChoiceFile,
    KernelChoice,
    Trial,
    choice_key,
    class_middles,
    half_octave_bucket,
    pow2_bucket,
    settle,
)

REPO = Path(__file__).resolve().parents[2]


class FakeClock:
    """A clock that only moves when a candidate runs: each call of ``kernel(name)`` advances it
    by that candidate's cost, and counts the call."""

    def __init__(self, costs: dict[str, float], preempt=lambda name, call: False):
        self.costs, self.now, self.calls = costs, 0.0, dict.fromkeys(costs, 0)
        # which calls are preempted: True loses a core for 30 ms, "brief" for no measurable time
        self.preempt, self.switched = preempt, 0
        self.cpu_s = 0.0  # the process's CPU time: every thread busy, but not while preempted

    def __call__(self) -> float:
        return self.now

    def switches(self) -> int:
        return self.switched

    def cpu(self) -> float:
        return self.cpu_s

    def candidates(self, value: torch.Tensor | None = None) -> dict:
        def kernel(name):
            def run():
                cost = self.costs[name]  # (seconds, or a function of the call's number)
                cost = cost(self.calls[name] + 1) if callable(cost) else cost
                self.now += cost
                self.cpu_s += cost * torch.get_num_threads()
                self.calls[name] += 1
                stall = self.preempt(name, self.calls[name])
                if stall:
                    self.now += 30e-3 if stall is True else 0.0
                    self.switched += 1
                return torch.ones(3) if value is None else value[name]

            return run

        return {name: kernel(name) for name in self.costs}


def decide(choice, shape, clock, outs=None, dtype=torch.float32):
    """Settles ``shape`` (`KernelChoice.measure`, as a settle step does); the decision."""
    decision = choice.measure(shape, dtype, clock.candidates(outs))
    if decision is None:
        raise AssertionError(f"{shape}: never decided")
    return decision


def _chooser(tmp_path, clock, op="op", rounds=2, budget_s=0.0):
    file = ChoiceFile(tmp_path / "c.json")
    return KernelChoice(
        op,
        rounds=rounds,
        budget_s=budget_s,
        timer=clock,
        switches=clock.switches,
        cpu_timer=clock.cpu,
        file=file,
    )


def test_picks_the_fastest_and_times_once(tmp_path):
    clock = FakeClock({"a": 3e-3, "b": 1e-3, "c": 2e-3})
    choice = _chooser(tmp_path, clock)
    assert choice.decision((8, 64), torch.float32) is None
    decide(choice, (8, 64), clock)
    # each once untimed, then one candidate a call, until each was timed twice
    assert clock.calls == {"a": 3, "b": 3, "c": 3}
    decision = choice.decision((8, 64), torch.float32)
    assert decision.choice == "b" and decision.source == "timed"
    assert decision.ms == {"a": 3.0, "b": 1.0, "c": 2.0}
    for _ in range(3):  # decided: the winner runs alone
        choice.run((8, 64), torch.float32, clock.candidates())
    assert clock.calls == {"a": 3, "b": 6, "c": 3}
    decide(choice, (16, 64), clock)  # a new shape class is timed
    assert clock.calls == {"a": 6, "b": 9, "c": 6}
    decide(choice, (16, 64), clock)  # ... once
    assert clock.calls == {"a": 6, "b": 9, "c": 6}


def test_one_lucky_call_does_not_win(tmp_path):
    """A candidate whose calls mostly take 3 ms loses to one that takes 2 ms every time, though
    one of its calls took 1 ms (a cache state or a smaller call of the class: on a fresh AVX-512
    host the fastest calls kept a MoE layout 1.5x slower in a step than the other)."""
    clock = FakeClock({"steady": 2e-3, "lucky": lambda call: 1e-3 if call == 3 else 3e-3})
    decide(_chooser(tmp_path, clock, rounds=5), (8,), clock)
    decision = _chooser(tmp_path, FakeClock({})).decision((8,), torch.float32)
    assert decision.choice == "steady"
    assert decision.ms == {"steady": 2.0, "lucky": 3.0}


def test_serving_never_runs_a_candidate_on_trial(tmp_path):
    """After settling, `run` calls the kept candidate and nothing else, call after call; a
    class nobody settled runs the default (the first candidate, the reference), never a
    trial, and keeps running it: its outputs never change."""
    clock = FakeClock({"ref": 3e-3, "fast": 1e-3, "mid": 2e-3})
    choice = _chooser(tmp_path, clock)
    decide(choice, (8,), clock)
    settled = dict(clock.calls)
    for _ in range(50):
        choice.run((8,), torch.float32, clock.candidates())
    assert clock.calls == {**settled, "fast": settled["fast"] + 50}
    for _ in range(50):  # a class met only now
        choice.run((16,), torch.float32, clock.candidates())
    assert clock.calls == {"ref": settled["ref"] + 50, "fast": settled["fast"] + 50,
                           "mid": settled["mid"]}  # fmt: skip
    assert choice.decision((16,), torch.float32) is None  # (nothing was timed)
    assert choice.defaulted() == [((16,), torch.float32, torch.get_num_threads())]


def test_short_kernels_get_more_rounds(tmp_path):
    clock = FakeClock({"a": 3e-3, "b": 1e-3})  # 4 ms a round
    decide(_chooser(tmp_path, clock, budget_s=0.01), (8,), clock)
    # the first call, then timed calls until each has 2 and they add up to 10 ms: a b a b a
    assert clock.calls == {"a": 4, "b": 3}
    clock = FakeClock({"a": 3e-3, "b": 1e-3})
    choice = KernelChoice(
        "op", timer=clock, switches=clock.switches, cpu_timer=clock.cpu, budget_s=1.0, max_rounds=5
    )
    choice.file = ChoiceFile(tmp_path / "d.json")
    decide(choice, (8,), clock)
    assert clock.calls == {"a": 6, "b": 6}  # capped at max_rounds


def test_returns_the_winners_output(tmp_path):
    clock = FakeClock({"slow": 2e-3, "fast": 1e-3})
    outs = {"slow": torch.tensor([1.0, 2.0]), "fast": torch.tensor([1.0, 2.0 + 1e-7])}
    choice = _chooser(tmp_path, clock)
    decide(choice, (1,), clock, outs)
    assert choice.run((1,), torch.float32, clock.candidates(outs)) is outs["fast"]


def test_a_disagreeing_candidate_is_never_chosen(tmp_path, caplog):
    clock = FakeClock({"ref": 2e-3, "wrong": 1e-3})
    outs = {"ref": torch.tensor([1.0, 2.0]), "wrong": torch.tensor([1.0, 2.5])}
    choice = _chooser(tmp_path, clock)
    with caplog.at_level(logging.WARNING):
        decide(choice, (1,), clock, outs)
    got = choice.run((1,), torch.float32, clock.candidates(outs))
    assert got is outs["ref"] and "disagrees" in caplog.text
    assert choice.decision((1,), torch.float32).choice == "ref"


def test_the_cache_file_round_trips(tmp_path):
    clock = FakeClock({"a": 3e-3, "b": 1e-3})
    decide(_chooser(tmp_path, clock), (4,), clock)
    entries = json.loads((tmp_path / "c.json").read_text())
    assert [e["choice"] for e in entries.values()] == ["b"]
    # a new process on the same machine: decided from the file, nothing timed
    clock2 = FakeClock({"a": 1e-3, "b": 3e-3})
    later = _chooser(tmp_path, clock2)
    decide(later, (4,), clock2)
    later.run((4,), torch.float32, clock2.candidates())
    assert clock2.calls == {"a": 0, "b": 1}
    decision = later.decision((4,), torch.float32)
    assert decision.choice == "b" and decision.source == "cache file"
    assert decision.ms == {"a": 3.0, "b": 1.0}
    # another op in the same file keeps the first one's entries
    decide(_chooser(tmp_path, clock2, op="other"), (4,), clock2)
    assert len(json.loads((tmp_path / "c.json").read_text())) == 2


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"k": 3}', ""])
def test_a_corrupt_cache_file_is_ignored_with_one_warning(tmp_path, caplog, text):
    (tmp_path / "c.json").write_text(text)
    clock = FakeClock({"a": 3e-3, "b": 1e-3})
    choice = _chooser(tmp_path, clock)
    with caplog.at_level(logging.WARNING):
        decide(choice, (4,), clock)
        decide(choice, (8,), clock)
    assert choice.decision((4,), torch.float32).choice == "b"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == (0 if text == '{"k": 3}' else 1)  # a stray entry is only skipped
    assert len(json.loads((tmp_path / "c.json").read_text())) >= 2  # rewritten whole


def test_an_unwritable_cache_dir_is_ignored_with_one_warning(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the directory should be
    clock = FakeClock({"a": 3e-3, "b": 1e-3})
    choice = KernelChoice(
        "op", budget_s=0, timer=clock, switches=clock.switches, cpu_timer=clock.cpu,
        file=ChoiceFile(blocker / "sub" / "c.json"),
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        for rows in (1, 2, 4):
            decide(choice, (rows,), clock)
    assert choice.decision((4,), torch.float32).choice == "b"
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_the_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITMOE_CACHE_DIR", str(tmp_path / "moved"))
    clock = FakeClock({"a": 3e-3, "b": 1e-3})
    choice = KernelChoice(
        "op",
        budget_s=0,
        timer=clock,
        switches=clock.switches,
        cpu_timer=clock.cpu,
        file=ChoiceFile(),
    )
    decide(choice, (4,), clock)
    assert (tmp_path / "moved" / "cpu_kernels-4.json").exists()


def test_keys_differ_by_everything_speed_depends_on():
    base = dict(
        op="moe", shape=(8, 64), dtype=torch.float32, threads=2, cpu="A", torch_version="2",
        kernels="k1",
    )  # fmt: skip
    key = choice_key(**base)
    for change in (
        {"cpu": "B"},
        {"dtype": torch.bfloat16},
        {"threads": 1},
        {"torch_version": "3"},
        {"kernels": "k2"},  # (a native kernel's source changed)
        {"op": "linear"},
        {"shape": (16, 64)},
    ):
        assert choice_key(**{**base, **change}) != key, change


def test_a_different_thread_count_is_timed_again(tmp_path):
    clock = FakeClock({"a": 3e-3, "b": 1e-3})
    choice = _chooser(tmp_path, clock)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        decide(choice, (4,), clock)
        torch.set_num_threads(2)
        decide(choice, (4,), clock)
    finally:
        torch.set_num_threads(threads)
    assert clock.calls == {"a": 6, "b": 6}
    assert len(json.loads((tmp_path / "c.json").read_text())) == 2


def test_pow2_bucket():
    got = [pow2_bucket(n) for n in (0, 1, 2, 3, 4, 5, 31, 32, 33)]
    assert got == [0, 1, 2, 4, 4, 8, 32, 32, 64]


def test_half_octave_bucket():
    """Powers of two and three quarters of them: each class half an octave wide."""
    got = [half_octave_bucket(n) for n in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 129, 192, 193)]
    assert got == [0, 1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 16, 192, 192, 256]
    assert all(half_octave_bucket(n) >= n for n in range(1000))


def test_no_kernel_choice_by_constants():
    """The CPU MoE layout and the oneDNN / MKL choice were thresholds tuned on one machine
    (`cpu_moe_path(rows, expert_elems)`, `ONEDNN_MIN_WEIGHT`); they are measured now."""
    pattern = re.compile(r"cpu_moe_path|ONEDNN_MIN_WEIGHT")
    hits = [
        f"{p.relative_to(REPO)}:{i}"
        for p in sorted((REPO / "splitmoe").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == []


def test_a_kernel_added_since_a_decision_is_measured(tmp_path):
    """A decision kept in the file without one of today's candidates (a kernel added since,
    e.g. the native MoE layout) is measured again with it; one that disagreed stays out."""
    clock = FakeClock({"a": 2e-3, "b": 3e-3})
    decide(_chooser(tmp_path, clock), (4, 4), clock)
    clock = FakeClock({"a": 2e-3, "b": 3e-3, "new": 1e-3})
    choice = _chooser(tmp_path, clock)
    decide(choice, (4, 4), clock)
    assert choice.kept((4, 4), torch.float32) == "new"
    assert set(choice.decision((4, 4), torch.float32).ms) == {"a", "b", "new"}
    # a candidate dropped for disagreeing is remembered: no new trial in the next process
    outs = {"a": torch.ones(3), "b": torch.ones(3), "new": torch.ones(3), "bad": torch.zeros(3)}
    clock = FakeClock({"a": 2e-3, "b": 3e-3, "new": 1e-3, "bad": 1e-4})
    first = _chooser(tmp_path, clock)
    decide(first, (8, 8), clock, outs)
    assert first.decision((8, 8), torch.float32).dropped == ("bad",)
    clock = FakeClock({"a": 2e-3, "b": 3e-3, "new": 1e-3, "bad": 1e-4})
    later = _chooser(tmp_path, clock)
    later.run((8, 8), torch.float32, clock.candidates(outs))
    assert clock.calls == {"a": 0, "b": 0, "new": 1, "bad": 0}


def test_preempted_calls_are_not_timed(tmp_path):
    """A call during which the process lost a core (its involuntary context switches moved)
    runs, but its time does not count: the fast kernel, preempted on its first two timed calls
    (30 ms each), still wins on the calls that were not, and the decision is kept in the
    file."""
    clock = FakeClock(
        {"slow": 2e-3, "fast": 1e-3}, preempt=lambda name, n: name == "fast" and n < 4
    )
    choice = _chooser(tmp_path, clock)
    decide(choice, (8,), clock)
    decision = choice.decision((8,), torch.float32)
    assert decision.choice == "fast" and decision.ms == {"slow": 2.0, "fast": 1.0}
    assert clock.calls == {"slow": 3, "fast": 5}  # the first call, 2 thrown away, 2 timed
    assert decision.source == "timed"
    assert _chooser(tmp_path, FakeClock({})).decision((8,), torch.float32).choice == "fast"


def test_on_contended_cores_the_choice_is_not_kept_for_later(tmp_path):
    """Every call preempted (ranks sharing cores): after `max_rounds` calls of each the class
    decides on the timings it got, in memory only; the next process measures again."""
    clock = FakeClock({"a": 2e-3, "b": 1e-3}, preempt=lambda name, n: True)
    choice = _chooser(tmp_path, clock)
    choice.max_rounds = 4
    decide(choice, (8,), clock)
    decision = choice.decision((8,), torch.float32)
    assert decision.choice == "b" and decision.source == "timed on contended cores"
    assert sum(clock.calls.values()) == 2 + 4 + 4  # the first call, then max_rounds each
    assert _chooser(tmp_path, FakeClock({})).decision((8,), torch.float32) is None


def test_a_brief_preemption_keeps_the_timing(tmp_path):
    """Preempted for no measurable time (the process's threads ran all along): the call's time
    counts, and the decision is kept in the file."""
    clock = FakeClock({"a": 2e-3, "b": 1e-3}, preempt=lambda name, n: "brief")
    choice = _chooser(tmp_path, clock)
    decide(choice, (8,), clock)
    assert clock.calls == {"a": 3, "b": 3}
    assert choice.decision((8,), torch.float32).source == "timed"


def test_a_failing_candidate_is_dropped_and_all_failing_raises(tmp_path, caplog):
    """A library without a kernel for the dtype on this CPU (oneDNN's bfloat16 inner product
    on an AVX2-only CPU) raises: that candidate is dropped and remembered, the others decide;
    where the reference is the one that fails, the next one that ran stands in for it; where
    every candidate raises, the caller gets the first's error."""

    def failing(cands: dict, *names: str) -> dict:
        def boom(name):
            def run():
                raise RuntimeError(f"{name}: could not create a primitive descriptor")

            return run

        return {n: (boom(n) if n in names else c) for n, c in cands.items()}

    clock = FakeClock({"ref": 2e-3, "broken": 1e-3, "fast": 1.5e-3})
    choice = _chooser(tmp_path, clock)
    with caplog.at_level(logging.WARNING):
        choice.measure((1,), torch.float32, failing(clock.candidates(), "broken"))
    got = choice.decision((1,), torch.float32)
    assert got.choice == "fast" and got.dropped == ("broken",)
    assert "'broken' failed (RuntimeError" in caplog.text
    # the next process reads the decision and never calls the failing kernel
    again = _chooser(tmp_path, clock)
    assert again.run((1,), torch.float32, failing(clock.candidates(), "broken")) is not None

    # the reference fails: the next candidate is the reference
    clock = FakeClock({"ref": 2e-3, "other": 1e-3})
    outs = {"ref": torch.tensor([1.0]), "other": torch.tensor([7.0])}
    choice = _chooser(tmp_path / "b", clock)
    choice.measure((2,), torch.float32, failing(clock.candidates(outs), "ref"))
    assert choice.run((2,), torch.float32, failing(clock.candidates(outs), "ref")) is outs["other"]

    # every candidate fails: the first's error, nothing decided
    choice = _chooser(tmp_path / "c", clock)
    with pytest.raises(RuntimeError, match="ref: could not"):
        choice.measure((3,), torch.float32, failing(clock.candidates(), "ref", "other"))
    assert choice.decision((3,), torch.float32) is None


def _trials(choice, clock, classes, builds=None):
    """A `Trial` per shape class ``(n,)`` of ``classes`` on ``clock``'s candidates (``builds``
    counts each class's builds)."""

    def build(n):
        if builds is not None:
            builds[n] = builds.get(n, 0) + 1
        return [clock.candidates()]

    names = tuple(clock.costs)
    return [Trial(choice, (n,), torch.float32, names, lambda n=n: build(n), n) for n in classes]


def test_settle_respects_its_time_budget(tmp_path):
    """A settle step with a budget stops measuring when it is spent (overrun by one call at
    most), smallest classes first; the classes it left run their default (the first
    candidate) when met, never a trial."""
    clock = FakeClock({"ref": 3e-3, "fast": 1e-3})  # 4 ms a round, 12 ms a class
    choice = _chooser(tmp_path, clock)
    report = settle(_trials(choice, clock, [64, 1, 16, 2, 32, 4, 8]), 0.05, timer=clock)
    assert report.seconds <= 0.05 + 3e-3
    decided = [c.shape for c in report.classes if c.decision is not None]
    left = [c.shape for c in report.left]
    assert decided == [(1,), (2,), (4,), (8,)] and left == [(16,), (32,), (64,)]
    assert all(c.decision.choice == "fast" for c in report.classes if c.decision is not None)
    assert choice.decision((32,), torch.float32) is None
    calls = dict(clock.calls)
    for _ in range(5):
        choice.run((32,), torch.float32, clock.candidates())
    assert clock.calls == {"ref": calls["ref"] + 5, "fast": calls["fast"]}
    assert "4 timed, 3 left to the default kernel" in report.summary()


def test_settle_takes_decisions_from_the_file_at_no_cost(tmp_path):
    """A later start finds the decided classes in the file (nothing built or run for them)
    and spends its budget on the ones left: start after start, every class gets measured."""
    clock = FakeClock({"ref": 3e-3, "fast": 1e-3})
    classes = [1, 2, 4, 8, 16, 32, 64]
    first = settle(_trials(_chooser(tmp_path, clock), clock, classes), 0.03, timer=clock)
    assert 0 < len(first.left) < len(classes)
    builds: dict = {}
    clock2 = FakeClock({"ref": 3e-3, "fast": 1e-3})
    later = _chooser(tmp_path, clock2)
    second = settle(_trials(later, clock2, classes, builds), None, timer=clock2)
    assert second.left == [] and second.count("cache file") == len(classes) - len(first.left)
    assert set(builds) == {c.shape[0] for c in first.left}  # (only those were built)
    assert clock2.calls["ref"] == 3 * len(first.left)  # 1 untimed + 2 timed calls of each


def test_settle_with_no_time_decides_nothing_and_serving_runs_the_reference(tmp_path):
    clock = FakeClock({"ref": 3e-3, "fast": 1e-3})
    choice = _chooser(tmp_path, clock)
    report = settle(_trials(choice, clock, [1, 2]), 0.0, timer=clock)
    assert len(report.left) == 2 and sum(clock.calls.values()) == 0
    assert choice.run((1,), torch.float32, clock.candidates()) is not None
    assert clock.calls == {"ref": 1, "fast": 0}


def test_class_middles():
    """The count a settle step times a class at: the middle of the counts in it."""
    assert class_middles(range(1, 20)) == {1: 1, 2: 2, 4: 4, 8: 7, 16: 13, 32: 18}
    pairs = [4 * t for t in range(1, 9)]  # a colocated call's pairs: tokens x top-4
    assert class_middles(pairs, half_octave_bucket) == {
        4: 4, 8: 8, 12: 12, 16: 16, 24: 24, 32: 32
    }  # fmt: skip


def test_one_process_measures_at_a_time(tmp_path):
    """`ChoiceFile.turn`: while one holder has the machine's turn another waits, until its
    deadline at most; once the turn is given back the next one gets it."""
    import time

    first, second = ChoiceFile(tmp_path / "c.json"), ChoiceFile(tmp_path / "c.json")
    with first.turn() as got:
        assert got
        t = time.perf_counter()
        with second.turn(t + 0.05) as waited:
            assert not waited and time.perf_counter() - t >= 0.05
    with second.turn(time.perf_counter() + 1.0) as got:
        assert got


def test_a_class_too_slow_for_the_budget_leaves_it_to_the_next(tmp_path):
    """A class whose timings would end past the deadline gives up as soon as its calls tell,
    and the classes after it get the time (a slow class does not stall every start)."""
    clock = FakeClock({"ref": 0.0, "fast": 0.0})
    choice = _chooser(tmp_path, clock)

    def build(scale):
        def call(cost):
            def run():
                clock.now += cost * scale
                clock.cpu_s += cost * scale * torch.get_num_threads()
                return torch.ones(3)

            return run

        return lambda: [{"ref": call(3e-3), "fast": call(1e-3)}]

    slow = Trial(choice, (1,), torch.float32, ("ref", "fast"), build(100.0), 1)
    cheap = [Trial(choice, (n,), torch.float32, ("ref", "fast"), build(1.0), n) for n in (2, 4)]
    report = settle([slow, *cheap], 1.0, timer=clock)
    assert [c.shape for c in report.left] == [(1,)]  # (0.4 s of warm-up, then it gave up)
    assert report.count("timed") == 2 and report.seconds < 0.45
