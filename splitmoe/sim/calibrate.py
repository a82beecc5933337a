"""Measures this machine's `HardwareProfile` (``scripts/calibrate_cpu.py`` is the command; the
scaling study does the same from its own runs).

What dominates a step here is not FLOPs: it is per-op host time, collective calls between rank
processes, and, once rank processes outnumber the cores, the OS waking ranks that sleep while
they wait. Two parts:

* in-process (`measure_hardware`, a few seconds, medians of repeats): ``peak_flops`` /
  ``mem_bytes_per_s`` from a 1-thread fp32 GEMM and a large copy; the attention and expert host
  overheads from the runtime's own `AttentionModel` and `LocalExperts` on the checkpoint, with
  the roofline part subtracted and lines fitted over batch sizes / activated experts;
* from end-to-end `LLM` runs (`fit_runs` on `CALIBRATION_RUNS`): the components' scale and the
  per-step costs, the multi-process driver costs, the 2-rank collective, and for more rank
  processes than cores the wake-up of one sleeping rank, the step boundary's cost per rank and
  the slow-down of per-token work. Every other configuration is left for validation.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from splitmoe.kernels.cpu_choice import (
    half_octave_bucket,
    last_level_cache_bytes,
    pow2_bucket,
    settle,
)
from splitmoe.sim.hardware import CURVES, HardwareProfile, Overheads

ROOFLINE_CPU = HardwareProfile(
    name="cpu-uncalibrated",
    peak_flops=50e9,
    mem_bytes_per_s=10e9,
    memory_bytes=16e9,
    gpus_per_node=64,
    flops_efficiency=1.0,
    mem_efficiency=1.0,
    weight_bytes=4,
    cores=float(os.cpu_count() or 1),
)


# The runtime's CPU kernel choices hold per size class (`pow2_bucket` of rows for the
# projections and the attention, `half_octave_bucket` of (token, expert) pairs for the
# experts), and a size just above a class's top runs the next class's kernel: the cost steps up
# there and stays about flat to the next top. A curve through the tops alone (1, 2, 4, 8, ...)
# would draw a line from 4 to 8 and under-charge the sizes just past 4 (a two-micro-batch step's
# 5 and 6), so both ends of every class are timed.
def class_ends(limit: int, per: int = 1, bucket=pow2_bucket) -> tuple[int, ...]:
    """Counts of 1 to ``limit`` at both ends of each class ``bucket(count * per)`` (the first
    and the last count in it), and ``limit``."""
    ends, last = {limit}, None
    for n in range(1, limit + 1):
        c = bucket(n * per)
        if c != last:
            ends.update((n, n - 1) if n > 1 else (n,))
            last = c
    return tuple(sorted(ends))


# sequences of the attention's timed decode steps (and rows of the LM head's), up to 64: every
# batch of the held-out sweep (docs/scaling.md §4) on one attention rank is then measured, not
# extrapolated along a curve's last segment
ATTENTION_GRID_SEQS = class_ends(64)
# the largest token count of the experts' timed decode calls (a micro-batch's routed tokens)
EXPERT_GRID_LIMIT = 64
# ... and a prefill step's (16-token prompts of 4 to 32 sequences): GEMMs of many rows per
# expert, where the per-pair cost of the decode grid is all but gone
EXPERT_PREFILL_TOKENS = (64, 128, 256, 512)


def expert_grid_tokens(top_k: int) -> tuple[int, ...]:
    """Token counts of the experts' timed decode calls: both ends of each class of pairs."""
    return class_ends(EXPERT_GRID_LIMIT, top_k, half_octave_bucket)


def expert_timed_tokens(top_k: int) -> tuple[int, ...]:
    """Every token count the experts are timed at, each once: the decode grid and the prefill
    points (64 is in both)."""
    return tuple(sorted(set(expert_grid_tokens(top_k) + EXPERT_PREFILL_TOKENS)))


def _median_time(fn, repeats: int = 7, inner: int = 1) -> float:
    """Median seconds of ``fn`` over ``repeats`` (of ``inner`` calls each), after one untimed
    call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)


def _interleaved_medians(points: dict, rounds: int = 9) -> dict:
    """Median of the seconds each of ``points`` (key -> a function returning the seconds of
    the work it timed) returns over ``rounds`` rounds, each calling every point in turn after
    all have settled: a host whose speed drifts (a shared VM's can, by tens of percent within an
    hour) then slows every point of a round alike, and the fits through them keep their shape, where
    timing one point after another would put the drift between the points. In each round a point is
    called twice and the second call kept: the first call after another size's pays for what that
    one left in the caches (the second call costs what a forward of decode steps does), where an
    engine's steps of one size follow each other. (The CPU kernel choices of the points' shapes are
    settled before, as a rank settles them before serving: `measure_components`.)"""
    for fn in points.values():
        fn()  # (one-off costs: allocations, oneDNN building its kernels)
    times: dict = {key: [] for key in points}
    for _ in range(rounds):
        for key, fn in points.items():
            fn()
            times[key].append(fn())
    return {key: statistics.median(ts) for key, ts in times.items()}


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``, both clamped at >= 0."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    b = max(b, 0.0)
    return max(my - b * mx, 0.0), b


def _nondecreasing(ys: list[float]) -> list[float]:
    """The closest non-decreasing sequence to ``ys`` in least squares (pool adjacent
    violators: a run that falls is replaced by its mean)."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(n)]


def _fit_nonnegative(rows: list[tuple[float, ...]], ys: list[float]) -> tuple[float, ...]:
    """Least-squares ``y = row . c`` with every ``c >= 0``: the best unconstrained fit over each
    subset of the columns (the others 0) that comes out non-negative (few columns: all subsets)."""
    a, y = torch.tensor(rows, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)
    n = a.shape[1]
    best, best_err = [0.0] * n, float(y.square().sum())
    for mask in range(1, 2**n):
        cols = [j for j in range(n) if mask >> j & 1]
        c = torch.linalg.lstsq(a[:, cols], y[:, None]).solution[:, 0]
        if (c < 0).any():
            continue
        err = float((a[:, cols] @ c - y).square().sum())
        if err < best_err:
            best, best_err = [0.0] * n, err
            for j, v in zip(cols, c.tolist()):
                best[j] = v
    return tuple(best)


# ---- roofline ---------------------------------------------------------------------------------
def measure_roofline() -> tuple[float, float]:
    """1-thread fp32 GEMM FLOP/s and copy bandwidth (bytes read + written per second)."""
    torch.set_num_threads(1)
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = 2 * n**3 / _median_time(lambda: a @ b, inner=4)
    src = torch.randn(16 * 2**20)  # 64 MiB
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src), inner=2)
    return flops, bw


# ---- in-process components --------------------------------------------------------------------
def _decode_meta(batch: int, context: int, block_size: int, query_len: int = 1):
    from splitmoe.kernels.attention_metadata import AttentionMetadata

    nblk = -(-context // block_size)
    tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(batch)]
    slots = [
        table[p // block_size] * block_size + p % block_size
        for table in tables
        for p in range(context - query_len, context)
    ]
    meta = AttentionMetadata.from_lists([query_len] * batch, [context] * batch, tables, slots)
    positions = torch.arange(context - query_len, context).repeat(batch)
    return meta, positions, batch * nblk


def fit_attention(
    sim, decode: dict[int, float], context: int, prefill: dict[int, float], prompt: int = 16
) -> dict:
    """The attention's host costs beyond ``sim``'s roofline, from the seconds of one layer's
    decode steps (``decode``: sequences -> seconds, each over ``context`` cached tokens) and of
    prefill chunks (``prefill``: sequences -> seconds, ``prompt`` new tokens each):
    ``attn_layer_s``, the ``seqs_layer_s`` curve, and ``prefill_seq_layer_s``, what a prefill
    sequence costs beyond a decode sequence's (`Simulator._attn` charges every sequence of a
    step along the curve, and a prefill one that too)."""
    batches = sorted(decode)
    ys = [decode[b] - sim._attn(b, b, 0, context)[0] for b in batches]
    # the cost is concave in the sequences (each of the first few adds several times what a
    # later one adds, so one line through all of them over-charges small batches): the fixed
    # part is where the small batches' line meets 0 sequences, the rest a curve through every
    # measured batch
    small = [i for i, b in enumerate(batches) if b <= 4]
    attn_layer_s, _ = _fit_line([batches[i] for i in small], [ys[i] for i in small])
    seqs_layer_s = [(b, max(0.0, y - attn_layer_s)) for b, y in zip(batches, ys)]
    per_seq = Overheads(seqs_layer_s=tuple(seqs_layer_s)).seqs_layer
    pre_b = sorted(prefill)
    ys = [
        prefill[b] - sim._attn(prompt * b, 0, b, prompt / 2)[0] - attn_layer_s - per_seq(b)
        for b in pre_b
    ]
    _, prefill_seq_layer_s = _fit_line(pre_b, ys)
    return dict(
        attn_layer_s=attn_layer_s,
        seqs_layer_s=seqs_layer_s,
        prefill_seq_layer_s=prefill_seq_layer_s,
    )


def measure_components(checkpoint: str | Path, hw: HardwareProfile) -> dict[str, float]:
    """Host overheads of the attention layers, the experts and the LM head of ``checkpoint``,
    1 thread."""
    from splitmoe.attention_nodes.kv_cache import PagedKVCache
    from splitmoe.attention_nodes.model import AttentionModel
    from splitmoe.attention_nodes.sampler import sample
    from splitmoe.expert_nodes.experts import LocalExperts
    from splitmoe.kernels.backends import attention_backend, moe_backend
    from splitmoe.models.config import ModelConfig
    from splitmoe.models.loader import load_attention_weights
    from splitmoe.sampling_params import SamplingParams
    from splitmoe.sim.model import ModelShape
    from splitmoe.sim.simulator import Simulator

    torch.set_num_threads(1)
    cfg = ModelConfig.from_hf(checkpoint)
    shape = ModelShape.from_config(checkpoint)
    sim = Simulator(shape, hw)
    g, layers = load_attention_weights(cfg, torch.float32, "cpu")
    cpu = torch.device("cpu")
    model = AttentionModel(cfg, g, layers, cpu, attention_backend("torch", cpu))
    L = cfg.num_layers

    experts = LocalExperts(
        cfg, list(range(cfg.num_experts)), torch.float32, cpu, moe_backend("torch", cpu)
    )
    moe_layers = [i for i, layer in enumerate(model.layers) if layer.router is not None]

    def layers_once(h, pos, meta, kv) -> float:
        # an attention rank's per-layer work as a step runs it (`layer_segment`: norms, the
        # attention over the paged KV, the router) on the MoE layers, timed; each layer's
        # experts (and a dense layer whole) run untimed in between, as in a step, so the next
        # layer's weights come from memory, not from the cache (timed back to back, layers
        # would look faster than a forward runs them)
        cos_sin = model.rope(pos, h.dtype)
        seconds = 0.0
        for i in range(L):
            t = time.perf_counter()
            h, x, routing = model.layer_segment(i, h, None, cos_sin, kv.layer(i), meta)
            if routing is not None:
                seconds += time.perf_counter() - t
                experts.compute(i, x, *routing)
        return seconds / len(moe_layers)

    def attn_point(batch: int, context: int, qlen: int):
        meta, pos, blocks = _decode_meta(batch, context, 16, qlen)
        kv = PagedKVCache(L, blocks, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        h = torch.randn(batch * qlen, cfg.hidden_size)
        return lambda: layers_once(h, pos, meta, kv)

    greedy = SamplingParams(temperature=0.0)

    def head_point(rows: int):
        # one micro-batch's LM head and greedy sampling, as the runtime runs them when the
        # micro-batch is done (its weights, read once a step, come from memory)
        h = torch.randn(rows, cfg.hidden_size)

        def head() -> float:
            t = time.perf_counter()
            sample(model.logits(h), [greedy] * rows, [None] * rows)
            return time.perf_counter() - t

        return head

    # tokens routed as in a step (each to top_k of all the experts, uniformly: the router of a
    # model's step spreads them so, `LLM.expert_load`), drawn anew at every call so that the
    # weights stream from memory as in a model step, at the token counts a micro-batch has. The
    # distinct experts saturate as the tokens grow while the pairs do not, which sets the
    # per-expert and per-pair costs apart. (Pools of k or 2k experts would weight the fit
    # towards GEMMs of many rows per expert, which no step of these sizes runs.)
    k, E, g = cfg.top_k, cfg.num_experts, torch.Generator().manual_seed(0)

    def moe_point(tokens: int):
        calls = []
        for _ in range(8):
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
            x, w = torch.randn(tokens, cfg.hidden_size), torch.full((tokens, k), 1.0 / k)
            calls.append((x, ids.int(), w, len(set(ids.flatten().tolist()))))

        def moe() -> float:
            t = time.perf_counter()
            for j, layer in enumerate(moe_layers):
                x, ids, w, _ = calls[j % len(calls)]
                experts.compute(layer, x, ids, w)
            calls.append(calls.pop(0))  # (the next call: other experts in each layer)
            return (time.perf_counter() - t) / len(moe_layers)

        return moe, statistics.mean(c[3] for c in calls)

    context = 32
    batches = ATTENTION_GRID_SEQS
    grid_tokens = expert_grid_tokens(k)
    pre_b = [1, 4, 8]
    moe_tokens = expert_timed_tokens(k)
    # the runtime's kernel choices for every shape timed here, settled first as a rank settles
    # them before serving (no time limit): what runs below is what a rank would run
    from splitmoe.kernels.settle import Shapes, model_trials

    most = max(max(batches), 16 * max(pre_b))  # rows of a step: decode rows, prompt chunks
    shapes = Shapes(seqs=max(batches), tokens=most, context=context, block_size=16,
                    expert_tokens=max(moe_tokens))  # fmt: skip
    settle(model_trials(shapes, torch.float32, model, experts))
    points = {("decode", b): attn_point(b, context, 1) for b in batches}
    points.update({("prefill", b): attn_point(b, 16, 16) for b in pre_b})
    points.update({("head", b): head_point(b) for b in batches})
    active = {}
    for tokens in moe_tokens:
        points["moe", tokens], active[tokens] = moe_point(tokens)
    with torch.inference_mode():
        t = _interleaved_medians(points)
    # (a cost does not fall as its count grows: where a median did, it was the host's noise)
    for kind, counts in (("decode", batches), ("moe", moe_tokens), ("head", batches)):
        for n, v in zip(counts, _nondecreasing([t[kind, n] for n in counts])):
            t[kind, n] = v

    attention = fit_attention(sim, {b: t["decode", b] for b in batches}, context,
                              {b: t["prefill", b] for b in pre_b})  # fmt: skip
    # what each timed call took beyond the roofline
    rest = {n: t["moe", n] - sim._experts(n * k, active[n]) for n in moe_tokens}
    # the per-layer, per-expert and per-pair terms (what a skewed or spread load changes)
    moe_layer_s, expert_s, pair_s = _fit_nonnegative(
        [(1.0, active[n], n * k) for n in grid_tokens], [rest[n] for n in grid_tokens]
    )
    # ... and the pairs' cost as what each timed call measured beyond the other two: the three
    # terms alone cannot hold the class steps (nor a prefill's GEMMs of many rows per expert,
    # which run near the roofline: the fitted line, extrapolated to a prefill's pairs, charges
    # them more than twice what they take)
    pairs_layer_s = [
        (n * k, max(0.0, rest[n] - moe_layer_s - expert_s * active[n])) for n in moe_tokens
    ]
    return dict(
        **attention,
        moe_layer_s=moe_layer_s,
        expert_s=expert_s,
        pair_s=pair_s,
        pairs_layer_s=pairs_layer_s,
        head_rows_s=[(b, t["head", b]) for b in batches],
    )


# ---- fitted from end-to-end runs -------------------------------------------------------------
# (attention ranks, expert ranks, sequences, micro-batches) of the closed-batch `LLM` runs the
# step-level constants are fitted from, in fitting order (flat transport, static balancer);
# prompts of CALIBRATION_PROMPT tokens, each generating CALIBRATION_TOKENS. Every other
# configuration is left for validation.
CALIBRATION_RUNS = (
    (1, 0, 1, 1), (1, 0, 16, 1), (2, 0, 1, 1), (2, 0, 16, 1), (1, 1, 1, 1), (1, 1, 16, 1),
    (1, 2, 1, 1), (1, 2, 16, 1), (1, 0, 1, 2), (1, 2, 1, 2), (2, 1, 2, 1),
)  # fmt: skip
CALIBRATION_PROMPT = 16
CALIBRATION_TOKENS = 32
# The dtype the CPU profile models (its roofline and components are timed in float32): runs it
# is fitted to or checked on must use it, not ``dtype="auto"`` (bfloat16 on CPUs that multiply
# it natively, float32 elsewhere).
CALIBRATION_DTYPE = "float32"


def _solve(f, lo: float, hi: float, iters: int = 50) -> float:
    """The root of increasing ``f`` in ``[lo, hi]`` by bisection (an end if none inside)."""
    if f(lo) >= 0:
        return lo
    if f(hi) <= 0:
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _scaled(hw: HardwareProfile, speed: float, step_s: float) -> HardwareProfile:
    """``hw`` with host overheads and roofline ``speed`` times faster, and ``step_s``."""
    oh = hw.overheads
    per_layer = {
        k: getattr(oh, k) / speed
        for k in (
            "attn_layer_s",
            "seq_layer_s",
            "prefill_seq_layer_s",
            "moe_layer_s",
            "expert_s",
            "pair_s",
        )
    }
    curves = {name: tuple((n, t / speed) for n, t in getattr(oh, name)) for name in CURVES}
    return replace(
        hw,
        peak_flops=hw.peak_flops * speed,
        mem_bytes_per_s=hw.mem_bytes_per_s * speed,
        overheads=replace(oh, step_s=step_s, seq_step_s=0.0, **curves, **per_layer),
    )


def decode_step_time(records: list[list], fallback: float) -> float:
    """Median seconds between consecutive pure-decode steps of one attention rank, as the rank
    timed them (`StepRecord.time`), over the step records of one or more instances: the decode
    step time. (Client-side token gaps are not: with several rank processes the driver receives
    tokens in bursts, so the median gap is about two steps.)"""
    gaps = []
    for recs in records:
        by_rank: dict[int, list] = {}
        for s in recs:
            by_rank.setdefault(s.rank, []).append(s)
        for steps in by_rank.values():
            steps.sort(key=lambda s: s.time)
            for a, b in zip(steps, steps[1:]):
                if a.num_seqs == a.num_decode and b.num_seqs == b.num_decode > 0:
                    gaps.append(b.time - a.time)
    return statistics.median(gaps) if gaps else fallback


def _fit_oversubscribed(hw: HardwareProfile, err) -> HardwareProfile:
    """``hw`` with the ``oversubscribed`` slow-down that zeroes ``err(profile)``."""
    k = _solve(lambda k: err(replace(hw, oversubscribed=k)), 1.0, 50.0)
    return replace(hw, oversubscribed=k)


def fit_runs(
    shape, hw: HardwareProfile, tbt: dict[tuple[int, int, int, int], float]
) -> HardwareProfile:
    """Fits ``step_s`` and the components' scale (1 colocated rank at 1 and 16 sequences), the
    multi-process step costs ``proc_step_s`` and ``busy_attention_step_s`` (2 colocated ranks
    at 1 and 16 sequences), ``collective_s`` and ``proc_seq_step_s`` (1 attention + 1 expert
    rank at 1 and 16 sequences), ``wake_s``,
    ``shared_step_s`` and ``oversubscribed`` (1 + 2 ranks at 1 sequence in two micro-batches,
    at 1 and at 16 sequences), ``shared_attention_step_s`` (2 + 1 ranks at 2 sequences, one
    each) and ``empty_micro_batch_s`` (1 colocated rank, 1 sequence in two micro-batches) so
    the simulator reproduces the measured decode step time (seconds) of the `CALIBRATION_RUNS`
    present in ``tbt``, in that order; ``cores`` is the machine's count; constants without a
    run keep ``hw``'s value."""
    from splitmoe.sim.simulator import Deployment, Simulator

    tbt = {k[:3] if len(k) == 4 and k[3] == 1 else k: v for k, v in tbt.items()}

    def pred(h: HardwareProfile, a: int, e: int, b: int, m: int = 1) -> float:
        run = Simulator(shape, h).run(
            Deployment(a, e, micro_batches=m), b, CALIBRATION_PROMPT, CALIBRATION_TOKENS, 2048
        )
        return run.tbt

    if (1, 0, 1) in tbt and (1, 0, 16) in tbt:
        # The components were timed in-process, the runs under whatever else the machine was
        # doing then: keep the components' proportions, fit their scale (``speed``) and the fixed
        # per-step cost so both colocated runs are reproduced.
        def at(speed: float, step_s: float) -> HardwareProfile:
            return _scaled(hw, speed, step_s)

        def step_for(speed: float) -> float:
            return max(0.0, tbt[(1, 0, 1)] - pred(at(speed, 0.0), 1, 0, 1))

        speed = _solve(lambda f: tbt[(1, 0, 16)] - pred(at(f, step_for(f)), 1, 0, 16), 0.05, 20.0)
        hw = at(speed, step_for(speed))

    def fit(key: tuple[int, ...], at, hi: float) -> HardwareProfile:
        """``at(c)`` (a profile with one constant set to ``c``) at the ``c`` in ``[0, hi]`` that
        reproduces calibration run ``key``."""
        return at(_solve(lambda c: pred(at(c), *key) - tbt[key], 0.0, hi))

    def fit_overhead(name: str, key: tuple[int, ...], hi: float) -> HardwareProfile:
        """``hw`` with the host overhead ``name`` that reproduces calibration run ``key``."""
        return fit(key, lambda c: replace(hw, overheads=replace(hw.overheads, **{name: c})), hi)

    def with_collective(c: float) -> HardwareProfile:
        """A collective call costs ``c`` among any number of ranks (what sharing the cores adds
        is counted in wake-ups)."""
        oh = replace(hw.overheads, collective_s=(0.0, c), collective_slope_s=0.0)
        return replace(hw, overheads=oh)

    # more than one rank process, each on a core of its own: the driver's step (2 colocated
    # ranks at 1 sequence: one has work), the wait for the slower of two ranks with work (at
    # 16), one collective call (1 + 1 at 1) and what each sequence's trips through an expert
    # rank add (1 + 1 at 16); they share terms: fit them in turn until the four are reproduced
    from splitmoe.runtime import available_cores

    hw = replace(hw, cores=float(len(available_cores())))  # (this process's, `taskset` too)

    for _ in range(6):
        if (2, 0, 1) in tbt:
            hw = fit_overhead("proc_step_s", (2, 0, 1), 0.05)
        if (1, 1, 1) in tbt:
            hw = fit((1, 1, 1), with_collective, 0.05)
        if (2, 0, 16) in tbt:
            hw = fit_overhead("busy_attention_step_s", (2, 0, 16), 0.05)
        if (1, 1, 16) in tbt:
            hw = fit_overhead("proc_seq_step_s", (1, 1, 16), 0.01)

    # more rank processes than cores (they sleep while they wait): the wake-up of one rank
    # (from what a second, empty micro-batch's exchange adds to 1+2 at 1 sequence), the step
    # boundary's cost per rank (1+2 at 1), what a second attention rank's adds (2+1 at 2: 1+2
    # with one of its expert ranks an attention rank) and the slow-down of per-token work (1+2
    # at 16) depend on each other: fit them in turn until the four runs are reproduced.
    for _ in range(30 if (1, 2, 16) in tbt else 1):
        if (1, 2, 1, 2) in tbt:  # a second micro-batch's round trip: its wake-ups
            hw = fit_overhead("wake_s", (1, 2, 1, 2), 0.05)
        if (1, 2, 1) in tbt:  # the rest of a step of sleeping ranks: once per step
            hw = fit_overhead("shared_step_s", (1, 2, 1), 0.05)
        if (2, 1, 2) in tbt:  # ... and a second attention rank's
            hw = fit_overhead("shared_attention_step_s", (2, 1, 2), 0.05)
        if (1, 2, 16) in tbt:
            hw = _fit_oversubscribed(hw, lambda h: pred(h, 1, 2, 16) - tbt[(1, 2, 16)])
    if (1, 0, 1, 2) in tbt:  # an empty micro-batch's pass through the layers, colocated
        hw = fit_overhead("empty_micro_batch_s", (1, 0, 1, 2), 0.01)
    return hw


def measure_calibration_runs(
    checkpoint: str | Path, max_world: int = 4, repeats: int = 3, log=print
) -> dict[tuple[int, int, int, int], float]:
    """Decode step time (seconds) of each of `CALIBRATION_RUNS` that fits in ``max_world``
    ranks: the fastest of its repeats' median step periods."""
    from splitmoe import LLM, SamplingParams

    out = {}
    g = torch.Generator().manual_seed(0)
    topologies = sorted({(a, e, m) for a, e, _, m in CALIBRATION_RUNS if a + e <= max_world})
    for a, e, m in topologies:
        with LLM(str(checkpoint), attention_ranks=a, expert_ranks=e, micro_batches=m,
                 device="cpu", dtype=CALIBRATION_DTYPE, threads_per_rank=1,
                 timeout_s=120) as llm:  # fmt: skip
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
            for key in CALIBRATION_RUNS:
                if (key[0], key[1], key[3]) != (a, e, m):
                    continue
                b = key[2]
                prompts = torch.randint(1, 500, (b, CALIBRATION_PROMPT), generator=g).tolist()
                sp = SamplingParams(max_tokens=CALIBRATION_TOKENS, ignore_eos=True)
                times = []
                for _ in range(repeats):
                    llm.reset_metrics()
                    llm.generate(prompts, sp, use_tqdm=False)
                    times.append(decode_step_time([llm.step_records], llm.metrics().tbt_p50))
                out[key] = min(times)  # (the least disturbed: `validate.measured_step_ms`)
                log(f"calibration run {a}A+{e}E m={m} batch {b}: step {out[key] * 1e3:.2f} ms")
    return out


def measure_hardware(checkpoint: str | Path, log=print) -> HardwareProfile:
    """The in-process part: roofline and component overheads (a few seconds)."""
    flops, bw = measure_roofline()
    log(f"roofline: {flops / 1e9:.1f} GFLOP/s fp32 GEMM, {bw / 1e9:.1f} GB/s copy (1 thread)")
    cache = last_level_cache_bytes()
    log(f"last-level cache: {cache / 2**20:.0f} MiB")
    hw = replace(ROOFLINE_CPU, peak_flops=flops, mem_bytes_per_s=bw, cache_bytes=float(cache))
    comp = measure_components(checkpoint, hw)

    def us(v) -> str:  # (the curves: count:us pairs)
        return " ".join(f"{n}:{us(t)}" for n, t in v) if isinstance(v, list) else f"{v * 1e6:.1f}"

    log("components: " + ", ".join(f"{k} {us(v)} us" for k, v in comp.items()))
    return replace(hw, overheads=Overheads(**comp))


def calibrate(
    checkpoint: str | Path,
    max_world: int = 4,
    runs: dict[tuple[int, int, int], float] | None = None,
    log=print,
) -> HardwareProfile:
    """`measure_hardware`, then `fit_runs` on ``runs`` (measured here when None)."""
    import platform

    from splitmoe.sim.model import ModelShape

    t0 = time.time()
    hw = measure_hardware(checkpoint, log)
    if runs is None:
        runs = measure_calibration_runs(checkpoint, max_world, log=log)
    hw = fit_runs(ModelShape.from_config(checkpoint), hw, runs)
    oh = hw.overheads
    log(
        f"fitted: step {oh.step_s * 1e3:.3f} ms + {oh.seq_step_s * 1e3:.3f} ms/seq, effective "
        f"cores {hw.cores:.2f}, collective "
        + ", ".join(f"W={w + 1} {c * 1e3:.3f} ms" for w, c in enumerate(oh.collective_s) if w)
    )
    return replace(
        hw,
        name="cpu",
        description=f"this machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, fp32, ranks as processes over gloo",
        source={
            "measured_by": "splitmoe.sim.calibrate.calibrate",
            "checkpoint": str(checkpoint),
            "runs_step_s": {f"{a}A+{e}E b{b} m={m}": t for (a, e, b, m), t in sorted(runs.items())},
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            "seconds": round(time.time() - t0, 1),
            "load_average": os.getloadavg()[0],
        },
    )


# ---- a GPU's measured kernel constants (scripts/bench_kernels.py --profile-fragment) ----------
KERNEL_FRAGMENT = "splitmoe.sim kernel fragment"


def apply_kernel_fragment(hw: HardwareProfile, fragment: dict) -> HardwareProfile:
    """``hw`` with the constants a GPU measured (``scripts/bench_kernels.py
    --profile-fragment``): ``mem_efficiency`` = the paged-decode kernel's best HBM bytes/s over
    the profile's peak, ``flops_efficiency`` = the MoE kernels' grouped-GEMM FLOP/s at the
    largest token count over the peak (each capped at 1; a figure the fragment lacks keeps the
    profile's value). The launch overhead per eager operation is recorded, not applied: the
    profiles' host overheads are for CUDA-graph decode, where launches are replayed. The
    fragment, and which constants it set, go into ``source["measured"]``."""
    if fragment.get("kind") != KERNEL_FRAGMENT:
        raise ValueError(
            f"not a kernel fragment (kind={fragment.get('kind')!r}): write one with "
            "scripts/bench_kernels.py --profile-fragment FILE on the GPU"
        )
    measured = fragment.get("measured", {})
    changes: dict[str, float] = {}
    if measured.get("hbm_bytes_per_s"):
        changes["mem_efficiency"] = min(1.0, measured["hbm_bytes_per_s"] / hw.mem_bytes_per_s)
    # (the peak is the 16-bit one: FLOP/s measured in another dtype say nothing about it)
    if measured.get("gemm_flops") and fragment.get("dtype") in ("bfloat16", "float16"):
        changes["flops_efficiency"] = min(1.0, measured["gemm_flops"] / hw.peak_flops)
    source = dict(hw.source)
    source["measured"] = {
        "device": fragment.get("device"),
        "dtype": fragment.get("dtype"),
        **measured,
        "applied": {k: round(v, 4) for k, v in changes.items()},
        "not applied": "launch_s (profiles assume CUDA-graph decode)",
        **{k: v for k, v in fragment.get("source", {}).items()},
    }
    return replace(hw, source=source, **changes)
