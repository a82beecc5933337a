"""``micro_batches="auto"``: the count each step runs with, chosen from the times the ranks
measure and share (`splitmoe.scheduler.micro_batches`)."""

from __future__ import annotations

import itertools
import random

import pytest
from tiny_models import prompt_ids

from splitmoe import LLM, SamplingParams
from splitmoe.comm.control import StepRow, StepSync
from splitmoe.config import ParallelConfig
from splitmoe.scheduler.micro_batches import (
    EXPLORE_EVERY,
    MIN_SAMPLES,
    RATIO_SAMPLES,
    MicroBatchChooser,
    _fit_two,
)
from splitmoe.timeline import StepTimes, Timeline


def _simulate(attention_per_token, expert_fixed, expert_per_token, trip, tokens, ranks=(1, 1)):
    """A synthetic job: the times each rank would measure at count m, from a known cost
    (seconds): every rank's attention compute, the experts' weight read per micro-batch and
    compute per token, and a round trip per micro-batch and layer folded into ``trip``."""

    def times(m: int) -> list[StepTimes]:
        att = attention_per_token * max(tokens)
        exp = expert_fixed * m + expert_per_token * sum(tokens)
        forward = max(att, exp, (att + exp + trip * m) / m)
        return [StepTimes(compute=att, wait=forward - att)] * ranks[0] + [
            StepTimes(compute=exp, wait=forward - exp)
        ] * ranks[1]

    return times


def _explorations(steps: int) -> int:
    """At most how many of ``steps`` (after the first 2 * MIN_SAMPLES) run the other count to
    keep it measured: every EXPLORE_EVERY // 4 steps until it has RATIO_SAMPLES, then every
    EXPLORE_EVERY."""
    return RATIO_SAMPLES - MIN_SAMPLES + steps // EXPLORE_EVERY + 1


def _run(chooser: MicroBatchChooser, times, tokens, steps: int) -> list[int]:
    counts = []
    for _ in range(steps):
        m = chooser.choose(tokens)
        counts.append(m)
        chooser.observe(times(m))
    return counts


def test_weight_bound_experts_run_one_micro_batch():
    # the 1+1 at batch 64: experts 57 ms at m=1, 111 at m=2 (their weights read twice)
    tokens = (64,)
    times = _simulate(19e-3 / 64, 54e-3, 3e-3 / 64, 5e-3, tokens)
    counts = _run(MicroBatchChooser(ParallelConfig(1, 1)), times, tokens, 3 * EXPLORE_EVERY)
    first = 2 * MIN_SAMPLES
    assert counts[:first] == [1, 2] * MIN_SAMPLES  # each measured in turn, then modelled
    later = counts[first:]
    assert later.count(1) >= len(later) - _explorations(len(later))
    assert set(later) <= {1, 2}


def test_attention_heavy_steps_run_two_micro_batches():
    # long contexts: attention 40 ms, experts 12 ms mostly per token; two overlap them
    tokens = (16,)
    times = _simulate(40e-3 / 16, 1e-3, 11e-3 / 16, 2e-3, tokens)
    chooser = MicroBatchChooser(ParallelConfig(1, 1))
    counts = _run(chooser, times, tokens, 3 * EXPLORE_EVERY)
    later = counts[2 * MIN_SAMPLES :]
    assert later.count(1) <= _explorations(len(later))  # only to keep m=1 measured
    # m=2, 3 and 4 all hide the experts behind attention here: the fewest of them runs
    assert [m for m in later if m != 1] == [2] * (len(later) - later.count(1))
    assert times(2)[0].total < 0.8 * times(1)[0].total


def test_a_count_slower_in_every_step_is_re_run_on_the_sure_schedule():
    # attention-heavy decode (m=2 ~25% faster, every step): once each count has run
    # MIN_SAMPLES steps, m=1 is not re-run every EXPLORE_EVERY / 4 steps as an unsure estimate
    # would be (in a 32-step decode that cost 2 of its steps), but still now and then
    tokens = (16,)
    times = _simulate(40e-3 / 16, 1e-3, 11e-3 / 16, 2e-3, tokens)
    assert times(1)[0].total > 1.2 * times(2)[0].total
    chooser = MicroBatchChooser(ParallelConfig(1, 1))
    counts = _run(chooser, times, tokens, 2 * MIN_SAMPLES + EXPLORE_EVERY)
    assert counts[: 2 * MIN_SAMPLES].count(1) == MIN_SAMPLES
    assert counts[2 * MIN_SAMPLES :] == [2] * EXPLORE_EVERY
    later = _run(chooser, times, tokens, 8 * EXPLORE_EVERY)
    assert 1 <= later.count(1) <= 4  # (predicted ~30% slower: every ~3 * EXPLORE_EVERY)
    # the same job with a fifth of the steps 50% slower: where the counts' steps overlap,
    # the unsure schedule stands (bounded as before)
    noisy = _run(MicroBatchChooser(ParallelConfig(1, 1)), _noisy(times, 3), tokens, 96)
    assert noisy[2 * MIN_SAMPLES :].count(1) <= _explorations(96 - 2 * MIN_SAMPLES)


def test_a_wrong_first_estimate_is_corrected():
    # the job changes under the chooser: attention-heavy first, then weight-bound
    tokens = (32,)
    chooser = MicroBatchChooser(ParallelConfig(1, 1))
    _run(chooser, _simulate(40e-3 / 32, 1e-3, 10e-3 / 32, 1e-3, tokens), tokens, 40)
    assert chooser.choose(tokens) >= 2
    chooser.observe(_simulate(40e-3 / 32, 1e-3, 10e-3 / 32, 1e-3, tokens)(2))
    counts = _run(chooser, _simulate(5e-3 / 32, 60e-3, 1e-3 / 32, 3e-3, tokens), tokens, 80)
    assert counts[-EXPLORE_EVERY // 2 :].count(1) >= EXPLORE_EVERY // 2 - 1


def _noisy(times, seed: int, spike: float = 0.5, every: float = 0.2):
    """``times`` with a shared host's noise: now and then (``every``) a step ``spike`` slower
    (a rank lost its core for a while), and a few percent of jitter on every step."""
    rng = random.Random(seed)

    def noisy(m: int) -> list[StepTimes]:
        f = rng.uniform(0.97, 1.03) * (1 + spike if rng.random() < every else 1.0)
        return [StepTimes(t.compute * f, t.comm * f, t.wait * f) for t in times(m)]

    return noisy


def test_a_much_slower_count_is_re_run_rarely():
    # m=1 takes twice m=2's time: re-running it every EXPLORE_EVERY steps would cost 3% of the
    # time; it is re-run about as much less often as it is slower
    tokens = (16,)
    times = _simulate(40e-3 / 16, 1e-3, 39e-3 / 16, 2e-3, tokens)
    assert times(1)[0].total > 1.9 * times(2)[0].total
    steps = 8 * EXPLORE_EVERY
    later = _run(MicroBatchChooser(ParallelConfig(1, 1)), times, tokens, steps)[2 * MIN_SAMPLES :]
    assert later.count(1) <= RATIO_SAMPLES - MIN_SAMPLES + 1
    assert later[-4 * EXPLORE_EVERY :].count(1) <= 1


def test_a_slow_step_now_and_then_does_not_flip_the_choice():
    # m=2 is ~15% faster; a fifth of the steps (of either count) are 50% slower at random
    tokens = (64,)
    clean = _simulate(30e-3 / 64, 23e-3, 10e-3 / 64, 3e-3, tokens)
    assert 0.8 < clean(2)[0].total / clean(1)[0].total < 0.9
    for seed in range(5):
        chooser = MicroBatchChooser(ParallelConfig(1, 1))
        later = _run(chooser, _noisy(clean, seed), tokens, 4 * EXPLORE_EVERY)[2 * MIN_SAMPLES :]
        assert later.count(2) >= len(later) - _explorations(len(later)) - 1, seed


def test_tied_counts_do_not_flip_step_after_step():
    # m=1 and m=2 within 1% of each other, with noise: the chooser settles, switching rarely
    tokens = (64,)
    clean = _simulate(30e-3 / 64, 33e-3, 10e-3 / 64, 3e-3, tokens)
    assert abs(clean(2)[0].total / clean(1)[0].total - 1) < 0.02
    for seed in range(5):
        chooser = MicroBatchChooser(ParallelConfig(1, 1))
        counts = _run(chooser, _noisy(clean, seed), tokens, 4 * EXPLORE_EVERY)
        later = counts[2 * MIN_SAMPLES :]
        runs = [len(list(g)) for _, g in itertools.groupby(later)]  # (exploring: runs of 1)
        changes = sum(a > 1 and b > 1 for a, b in zip(runs, runs[1:]))
        assert changes <= 2, (seed, later)


def _cost_of_measuring(clean, tokens, steps: int, seeds) -> float:
    """The mean over ``seeds`` of the best fixed count's time over ``steps`` steps of the noisy
    job ``clean`` against auto's (each seed's noise the same sequence for all three)."""
    ratios = []
    for seed in seeds:
        totals = {}
        for fixed in (None, 1, 2):
            chooser, times, t = MicroBatchChooser(ParallelConfig(1, 1)), _noisy(clean, seed), 0.0
            for _ in range(steps):
                step = times(chooser.choose(tokens) if fixed is None else fixed)
                chooser.observe(step)
                t += step[0].total
            totals[fixed] = t
        ratios.append(min(totals[1], totals[2]) / totals[None])
    return sum(ratios) / len(ratios)


def test_measuring_costs_little_over_a_short_decode():
    # a decode of 32 steps, with noise: what exploring the counts costs against the best fixed
    # count, where m=2 is ~25% faster (attention-heavy) and where it is ~35% slower (the
    # experts' weight read): the first steps of each count and the re-runs cost 3-4 % here
    tokens = (16,)
    heavy = _simulate(40e-3 / 16, 1e-3, 11e-3 / 16, 2e-3, tokens)
    bound = _simulate(19e-3 / 16, 54e-3, 3e-3 / 16, 5e-3, tokens)
    assert heavy(1)[0].total > 1.2 * heavy(2)[0].total
    assert bound(2)[0].total > 1.3 * bound(1)[0].total
    assert _cost_of_measuring(heavy, tokens, 32, range(10)) > 0.96
    assert _cost_of_measuring(bound, tokens, 32, range(10)) > 0.95


def test_a_slow_spell_does_not_keep_a_slower_count_running():
    # m=2 is ~40% faster than m=1 and ~20% faster than m=3; a fifth of the steps 50% slower.
    # The counts' corrections must not come from a count's last few steps alone: where two of
    # m=2's last three were slow, m=3 looked faster and ran until m=2's re-run ~32 steps later
    tokens = (16,)
    clean = _simulate(20e-3 / 16, 6e-3, 10e-3 / 16, 2e-3, tokens)
    assert clean(3)[0].total > 1.15 * clean(2)[0].total < 0.7 * clean(1)[0].total
    for seed in range(20):
        counts = _run(MicroBatchChooser(ParallelConfig(1, 1)), _noisy(clean, seed), tokens, 96)
        assert counts.count(3) + counts.count(4) <= 3, (seed, counts)


def test_a_count_never_run_is_not_predicted_from_a_model_missing_a_count():
    # once m=1's steps have left the model's window, the model cannot tell the experts' cost
    # per micro-batch from their cost per token: it predicts no count it has not run
    tokens = (16,)
    times = _simulate(40e-3 / 16, 1e-3, 39e-3 / 16, 2e-3, tokens)  # (m=1 twice m=2's time)
    chooser = MicroBatchChooser(ParallelConfig(1, 1))
    counts = _run(chooser, times, tokens, 2 * MIN_SAMPLES + 40)
    assert counts[-40:] == [2] * 40
    assert 1 not in {x.micro_batches for x in chooser.samples}
    assert [p.micro_batches for p in chooser.predictions(tokens)] == [1, 2]


def test_prefill_steps_do_not_bend_the_decode_choice():
    # decode steps of 16 tokens where m=2 wins, between prefill chunks of 2048 tokens whose
    # time the per-token model gets badly wrong (long prompts: attention grows with the context)
    decode, prefill = (16,), (2048,)
    d = _simulate(40e-3 / 16, 1e-3, 11e-3 / 16, 2e-3, decode)
    p = _simulate(40e-3 / 16, 1e-3, 11e-3 / 16, 2e-3, prefill)

    def slow_prefill(m: int) -> list[StepTimes]:  # 5x what the per-token costs say, at m=2
        f = 5.0 if m == 2 else 1.0
        return [StepTimes(t.compute * f, t.comm, t.wait * f) for t in p(m)]

    chooser = MicroBatchChooser(ParallelConfig(1, 1))
    counts = []
    for i in range(4 * EXPLORE_EVERY):
        tokens, times = (prefill, slow_prefill) if i % 8 == 0 else (decode, d)
        m = chooser.choose(tokens)
        chooser.observe(times(m))
        if tokens == decode:
            counts.append(m)
    later = counts[2 * MIN_SAMPLES :]
    assert later.count(2) >= len(later) - _explorations(len(later)) - 1


def test_a_batch_that_shrinks_starts_from_the_neighbouring_bucket():
    # attention-heavy decode of 16 requests (m=2 wins), then requests finish one by one: the
    # steps of 8-15 tokens take the choice of 16 tokens over, without running the slower m=1
    # MIN_SAMPLES times again in turn
    def times(tokens):
        return _simulate(40e-3 / 16, 1e-3, 11e-3 / 16, 2e-3, tokens)

    chooser = MicroBatchChooser(ParallelConfig(1, 1))
    _run(chooser, times((16,)), (16,), 40)
    tail = []
    for n in range(15, 7, -1):
        tail += _run(chooser, times((n,)), (n,), 2)
    # (m=1 is re-run on the neighbour's schedule alone: every EXPLORE_EVERY / 4 steps while
    # it has fewer than RATIO_SAMPLES steps)
    assert tail.count(1) <= len(tail) // (EXPLORE_EVERY // 4), tail
    # where the neighbour's choice is wrong, the bucket's own steps correct it: a job whose
    # experts' weight read dominates at 8-15 tokens (m=1 wins) next to the measured 16 tokens
    chooser = MicroBatchChooser(ParallelConfig(1, 1))
    _run(chooser, times((16,)), (16,), 40)
    light = _simulate(5e-3 / 12, 60e-3, 1e-3 / 12, 3e-3, (12,))
    assert light(1)[0].total < 0.7 * light(2)[0].total
    counts = _run(chooser, light, (12,), 3 * EXPLORE_EVERY)
    assert counts[: 2 * MIN_SAMPLES] != [1, 2] * MIN_SAMPLES  # (it did start from the neighbour)
    assert counts[-EXPLORE_EVERY:].count(1) >= EXPLORE_EVERY - 2, counts


def test_every_rank_chooses_alike_from_the_shared_numbers():
    # ranks see the same exchanged times (whatever order they arrive in on each rank) and
    # therefore make the same choices, step after step, with changing batches
    rng = random.Random(3)
    par = ParallelConfig(2, 2)
    ranks = [MicroBatchChooser(par) for _ in range(4)]
    for _ in range(200):
        tokens = (rng.randrange(0, 70), rng.randrange(1, 70))
        counts = {c.choose(tokens) for c in ranks}
        assert len(counts) == 1
        times = [StepTimes(*(rng.random() * 1e-2 for _ in range(3))) for _ in range(4)]
        for c in ranks:
            c.observe(times)
    assert len({tuple(sorted(c.chosen.items())) for c in ranks}) == 1
    assert len(ranks[0].chosen) >= 2  # (it did choose between counts)


def test_what_configuration_fixes_is_not_chosen():
    assert MicroBatchChooser(ParallelConfig(1, 1, micro_batches=3)).choose((1,)) == 3
    assert MicroBatchChooser(ParallelConfig(1, 0)).choose((100,)) == 1  # colocated
    assert MicroBatchChooser(ParallelConfig(1, 1)).choose((1,)) == 1  # one token: no split
    assert MicroBatchChooser(ParallelConfig(1, 1), shared_gpu=True).choose((64,)) == 1
    chooser = MicroBatchChooser(ParallelConfig(1, 1))
    tokens = (3,)  # never more micro-batches than tokens
    _run(chooser, _simulate(1e-2, 0.0, 1e-4, 0.0, tokens), tokens, 50)
    assert set(chooser.chosen) <= {1, 2, 3}


def test_fit_two_recovers_costs_and_stays_non_negative():
    rows = [(t, m, 2e-4 * t + 3e-3 * m) for t in (8, 16, 64) for m in (1, 2)]
    p, q = _fit_two(rows)
    assert p == pytest.approx(2e-4) and q == pytest.approx(3e-3)
    p, q = _fit_two([(t, 1, 5e-3 - 1e-5 * t) for t in (8, 64)])  # would be negative per token
    assert p == 0.0 and q > 0.0
    p, q = _fit_two([(32, 1, 4e-3)])  # one sample: the minimum-norm split, exact at that point
    assert p >= 0.0 and q >= 0.0 and 32 * p + q == pytest.approx(4e-3, rel=1e-3)
    assert _fit_two([]) == (0.0, 0.0)


def test_timeline_times_count_nested_spans_once():
    tl = Timeline()
    tl.take_times()
    with tl.span("forward", "compute"):
        with tl.span("dispatch", "comm"):
            pass
        with tl.span("combine", "wait"):
            sum(range(20000))
    with tl.span("flush", "wait"):
        pass
    t = tl.take_times()
    spans = tl.export()
    forward = spans[2].end - spans[2].start
    assert t.total == pytest.approx(forward + spans[3].end - spans[3].start)
    assert t.wait >= spans[1].end - spans[1].start > 0.0
    assert tl.take_times() == StepTimes()


def test_one_rank_exchange_carries_its_times():
    sync = StepSync(None, 1)
    d = sync.exchange(StepRow(4, False, times=StepTimes(1.5e-3, 2e-4, 3.25e-3)))
    assert d.times == (StepTimes(1.5e-3, 2e-4, 3.25e-3),)


PROMPTS = [prompt_ids(n, seed=140 + i) for i, n in enumerate((3, 12, 5, 9, 1, 7, 4, 10))]


def test_auto_matches_hf(tiny_ckpt, hf_ref):
    ckpt = tiny_ckpt("qwen3_moe")
    with LLM(
        str(ckpt),
        attention_ranks=2,
        expert_ranks=1,
        micro_batches="auto",
        dtype="float32",
        device="cpu",
    ) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        traces = llm.trace()
        stats = llm.stats()
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_ref(ckpt, p, 12)
    # the attention ranks ran the same count in every step (as the expert rank served)
    counts = [
        {s.step: s.name for s in t["timeline"] if s.name.startswith("forward m=")}
        for t in traces
        if t["role"] == "attention"
    ]
    assert counts[0] == counts[1]
    assert {"forward m=1", "forward m=2"} <= set(counts[0].values())  # both explored
    # every rank counted the same steps per count (`LLM.stats`)
    steps = [r["micro_batch_steps"] for r in stats]
    assert steps[0] == steps[1] == steps[2] and {"1", "2"} <= set(steps[0])
