"""Prefill-decode disaggregation in the planner: PD + AF against one pool (AF or colocated).

A workload is prompts of ``P`` tokens each generating ``O`` tokens, served under a TTFT and a
TPOT target; the figure of merit is requests per second per GPU (goodput: every request meets
both targets on average). Three kinds of deployment of ``G`` GPUs are compared:

* **one pool** (an AF ``A:E`` instance, or a colocated EP instance, replicated): every attention
  rank runs its ``B`` decode sequences and, with chunked prefill, the prompts' tokens in the same
  steps. In steady state ``B / O`` requests finish per step and as many arrive, so a step
  carries ``c = B P / O`` prompt tokens on average. They come as chunks of
  ``q = min(budget - B, max(P, c))`` tokens (``budget``: ``max_num_batched_tokens``) in a share
  ``f = c / q`` of the steps (``f >= 1``: the rank cannot keep up)::

      TPOT      = f t(B, q) + (1 - f) t(B, 0)          (t: `Simulator.step`)
      TPOT p99  = t(B, q) where f > 1 %: a decode step that carries a chunk
      TTFT      = ceil(P / q) t(B, q) (1 + f / (2 (1 - f)))   (M/D/1 wait at load f)

* **PD + AF**: ``n_p`` prefill instances (colocated EP over ``s`` GPUs: prefill is
  compute-bound, AF buys it nothing) and ``n_d`` AF decode instances (``A:E``), ``n_p s +
  n_d (A + E) <= G``. A prefill attention rank runs ``k`` whole prompts per step of ``t_p``
  seconds (``k`` searched: more prompts a step, more capacity, longer TTFT); the prompt's KV
  (``P`` tokens of every layer, a sliding-window layer's window only) crosses a link of
  ``bandwidth`` bytes/s to the decode instance, which runs pure decode steps of ``t_d`` seconds::

      TTFT = t_p ceil(P / budget) (1 + rho / (2 (1 - rho))) + alpha + bytes / bandwidth + t_d
      capacity of a prefill instance = s k / (t_p ceil(P / budget)) requests/s
      TPOT = t_d

  ``rho``: the prefill pool's load. The rate is the smaller of the two pools' capacities (the
  prefill pool's at the load its TTFT allows), with ``n_p`` chosen for the best split.

Both sides' ``t`` come from the same `Simulator`; the KV pull is assumed asynchronous (it does
not stall the decode instance's other sequences: today's runtime pulls inside the step, see
docs/pd.md) and its link is not shared with the expert exchange.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from splitmoe.sim.planner import CompareSpace, _experts_fit
from splitmoe.sim.simulator import Deployment, Simulator

_MAX_LOAD = 0.95  # a queue run closer to saturation than this waits unboundedly in practice


@dataclass(frozen=True)
class Workload:
    """Prompts of ``prompt_len`` tokens generating ``output_len`` each, under ``ttft_slo`` and
    ``tpot_slo`` seconds (``tpot_of``: the mean TPOT, or the p99: a one-pool decode step that
    carries a prompt chunk); ``max_num_batched_tokens``: the tokens an attention rank computes
    in one step (the scheduler's budget, as in `SchedulerConfig`)."""

    prompt_len: int
    output_len: int
    ttft_slo: float
    tpot_slo: float
    max_num_batched_tokens: int = 8192
    tpot_of: str = "mean"  # which TPOT the target bounds: "mean" or "p99" (a chunk's step)

    def __post_init__(self) -> None:
        if self.tpot_of not in ("mean", "p99"):
            raise ValueError(f"tpot_of={self.tpot_of!r} must be 'mean' or 'p99'")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("prompt_len and output_len must be >= 1")
        if not (self.ttft_slo > 0 and self.tpot_slo > 0):
            raise ValueError("ttft_slo and tpot_slo must be > 0 seconds")
        if self.max_num_batched_tokens < 2:
            raise ValueError("max_num_batched_tokens must be >= 2")

    @property
    def context(self) -> float:
        """Mean KV tokens of a decoding sequence."""
        return self.prompt_len + self.output_len / 2

    @property
    def max_context(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class PDSpace:
    """Where `compare` searches: AF instances (decode pools, and one-pool AF) and colocated EP
    sizes from ``compare``, prefill instances of ``prefill_sizes`` GPUs (colocated EP), and the
    decode batches per attention rank."""

    compare: CompareSpace = field(
        default_factory=lambda: CompareSpace(
            attention_ranks=(4, 8, 16, 32),
            expert_ranks=(8, 16, 32),
            micro_batches=(2,),
            colocated_sizes=(8, 16, 32),
            colocated_micro_batches=(1,),
        )
    )
    prefill_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    prompts_per_step: tuple[int, ...] = (1, 2, 4)  # a prefill rank's prompts per step
    batches: tuple[int, ...] = (4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512)


@dataclass(frozen=True)
class ServingPlan:
    """One deployment of the GPU budget serving the workload.

    kind: ``"PD+AF"``, ``"AF"`` or ``"colocated"`` (the last two: one pool). decode: the
    instance that decodes (the only one in a pool), ``decode_instances`` of it, ``batch``
    sequences per attention rank; prefill: PD's prefill instance, ``prefill_instances`` of it,
    each attention rank computing ``prompts_per_step`` prompts a step.
    Times in seconds; ``requests_per_s``: the whole budget's goodput."""

    kind: str
    decode: Deployment
    decode_instances: int
    batch: int
    ttft: float
    tpot: float
    tpot_p99: float
    requests_per_s: float
    gpus_budget: int
    output_len: int
    prefill: Deployment | None = None
    prefill_instances: int = 0
    transfer_s: float = 0.0
    prefill_load: float = 0.0  # PD: the prefill pool's load; a pool: the share of chunk steps
    prompts_per_step: int = 0

    @property
    def gpus(self) -> int:
        used = self.decode.ranks * self.decode_instances
        return used + (self.prefill.ranks * self.prefill_instances if self.prefill else 0)

    @property
    def per_gpu(self) -> float:
        """Requests per second per GPU of the budget (idle GPUs count)."""
        return self.requests_per_s / self.gpus_budget

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.per_gpu * self.output_len

    def label(self) -> str:
        dec = f"{self.decode.label()} x{self.decode_instances}"
        if self.prefill is None:
            return dec
        pre = f"{self.prefill.label()} x{self.prefill_instances} k={self.prompts_per_step}"
        return f"prefill {pre} + decode {dec}"


def transfer_bytes(sim: Simulator, prompt_len: int) -> float:
    """KV bytes of one prompt moved from the prefill to the decode instance: every layer's
    cache of the prompt (a sliding-window layer's window only), in the cache's element size."""
    m = sim.model
    return m.kv_bytes_per_token(sim.kv_bytes) * m.kv_context(prompt_len) * m.num_layers


def transfer_seconds(sim: Simulator, prompt_len: int, bandwidth: float | None = None) -> float:
    """One prompt's pull over a link of ``bandwidth`` bytes/s (default: the profile's network
    link), with its per-message latency."""
    link = sim.hw.links.inter
    return link.alpha_s + transfer_bytes(sim, prompt_len) / (bandwidth or link.bytes_per_s)


def _wait(load: float) -> float:
    """M/D/1 queueing: mean wait in units of the service time at ``load``."""
    return load / (2 * (1 - load))


def one_pool(sim: Simulator, dep: Deployment, wl: Workload, batch: int) -> ServingPlan | None:
    """``dep`` (replicated as ``dep.replicas``) running prefill and decode together with
    ``batch`` decode sequences per attention rank; None where it does not fit in memory or
    cannot keep up with its own prompts."""
    P, O, budget = wl.prompt_len, wl.output_len, wl.max_num_batched_tokens
    chunk_room = budget - batch
    if chunk_room < 1:
        return None
    c = batch * P / O  # prompt tokens per step per attention rank, on average
    q = min(chunk_room, max(P, c))
    f = c / q
    if f >= _MAX_LOAD:
        return None
    base = sim.decode(dep, batch, wl.context, wl.max_context)
    if not base.fits:
        return None
    t0 = base.step.t_step
    t1 = sim.step(dep, batch, wl.context, q, max(1.0, q / P)).t_step
    tpot = f * t1 + (1 - f) * t0
    ttft = math.ceil(P / q) * t1 * (1 + _wait(f))
    groups = dep.attention_ranks // dep.attention_tp
    rate = groups * batch * dep.replicas / (O * tpot)
    kind = "colocated" if dep.colocated else "AF"
    return ServingPlan(
        kind, dep, dep.replicas, batch, ttft, tpot, t1 if f > 0.01 else t0, rate,
        dep.gpus, O, prefill_load=f,
    )  # fmt: skip


def best_one_pool(
    sim: Simulator, deps: Iterable[Deployment], wl: Workload, gpus: int, batches: Iterable[int]
) -> list[ServingPlan]:
    """Per deployment, the batch with the best goodput meeting both targets; best first."""
    out = []
    for dep in deps:
        best = None
        for b in batches:
            p = one_pool(sim, dep, wl, b)
            if p is None:
                break  # (a larger batch neither fits nor keeps up)
            tpot = p.tpot_p99 if wl.tpot_of == "p99" else p.tpot
            if p.ttft > wl.ttft_slo or tpot > wl.tpot_slo:
                if best is not None:
                    break
                continue
            if best is None or p.requests_per_s > best.requests_per_s:
                best = p
        if best is not None:
            out.append(_budget(best, gpus))
    return sorted(out, key=lambda p: -p.per_gpu)


def _budget(p: ServingPlan, gpus: int) -> ServingPlan:
    from dataclasses import replace

    return replace(p, gpus_budget=gpus)


@dataclass(frozen=True)
class PrefillPool:
    """One prefill instance: its latency for a prompt (at no load), its capacity (requests/s
    at full load) and its GPUs."""

    deployment: Deployment
    latency: float
    capacity: float
    per_step: int = 1


def prefill_instance(
    sim: Simulator, size: int, wl: Workload, per_step: int = 1
) -> PrefillPool | None:
    """A colocated EP instance of ``size`` GPUs computing ``per_step`` whole prompts per step
    and attention rank (more: higher capacity, longer latency); None where the weights and the
    prompts' KV do not fit, or the prompts exceed the step's token budget."""
    dep = Deployment(size, 0, 1, "gpu_a2a", expert_parallel=size)
    P, budget = wl.prompt_len, wl.max_num_batched_tokens
    if per_step > 1 and per_step * P > budget:
        return None
    steps = math.ceil(P / budget)  # (a prompt longer than the budget: chunks)
    tokens = min(P * per_step, budget)
    attn_gb, _ = sim.memory_gb(dep, per_step, P)
    if attn_gb > sim.hw.memory_bytes / 1e9 * 0.9:
        return None
    t = sim.step(dep, 0, 0.0, tokens, per_step).t_step
    latency = steps * t
    return PrefillPool(dep, latency, size * per_step / latency, per_step)


def pd_plans(
    sim: Simulator,
    wl: Workload,
    gpus: int,
    space: PDSpace = PDSpace(),
    bandwidth: float | None = None,
) -> list[ServingPlan]:
    """PD + AF deployments of ``gpus``: per AF decode instance (best batch under the TPOT
    target) and prefill instance size, the split of the budget with the best goodput; best
    first."""
    from splitmoe.sim.planner import best_batch

    xfer = transfer_seconds(sim, wl.prompt_len, bandwidth)
    pools = [
        pool
        for s in space.prefill_sizes
        if s < gpus
        for k in space.prompts_per_step
        if (pool := prefill_instance(sim, s, wl, k)) is not None
    ]
    cs = space.compare
    out = []
    for a in cs.attention_ranks:
        for e in cs.expert_ranks:
            if e > sim.model.num_experts or not _experts_fit(sim, e, 0):
                continue
            for m in cs.micro_batches:
                dep = Deployment(a, e, m, cs.transport)
                d = best_batch(sim, dep, wl.tpot_slo, wl.context, space.batches)
                if d is None or not sim.decode(dep, d.batch, wl.context, wl.max_context).fits:
                    continue
                t_d = d.step.t_step
                cap_d = a * d.batch / (wl.output_len * d.tpot)  # requests/s per instance
                for pool in pools:
                    plan = _split(pool, dep, d.batch, t_d, cap_d, xfer, wl, gpus)
                    if plan is not None:
                        out.append(plan)
    return sorted(out, key=lambda p: -p.per_gpu)


def _split(
    pool: PrefillPool, dep: Deployment, batch: int, t_d: float, cap_d: float, xfer: float,
    wl: Workload, gpus: int,
) -> ServingPlan | None:  # fmt: skip
    """The best number of prefill instances beside as many decode instances as fit."""
    # the prefill pool's highest load whose TTFT still meets the target
    room = (wl.ttft_slo - xfer - t_d) / pool.latency - 1
    if room < 0:
        return None
    max_load = min(_MAX_LOAD, 2 * room / (1 + 2 * room) * (1 - 1e-9))  # (at, not past, it)
    best = None
    s = pool.deployment.ranks
    for n_p in range(1, gpus // s + 1):
        n_d = (gpus - n_p * s) // dep.ranks
        if n_d < 1:
            break
        rate = min(n_p * pool.capacity * max_load, n_d * cap_d)
        if best is None or rate > best[0]:
            best = (rate, n_p, n_d)
    if best is None or best[0] <= 0:
        return None
    rate, n_p, n_d = best
    load = rate / (n_p * pool.capacity)
    ttft = pool.latency * (1 + _wait(load)) + xfer + t_d
    return ServingPlan(
        "PD+AF", dep, n_d, batch, ttft, t_d, t_d, rate, gpus, wl.output_len,
        prefill=pool.deployment, prefill_instances=n_p, transfer_s=xfer, prefill_load=load,
        prompts_per_step=pool.per_step,
    )  # fmt: skip


@dataclass(frozen=True)
class PDVerdict:
    """The best plan of each kind (None: none meets both targets) and every plan found."""

    pd: ServingPlan | None
    af: ServingPlan | None
    colocated: ServingPlan | None
    plans: tuple[ServingPlan, ...] = ()

    def text(self) -> str:
        lines = []
        for name, p in (("PD+AF", self.pd), ("AF", self.af), ("colocated", self.colocated)):
            if p is None:
                lines.append(f"{name}: no deployment meets both targets within memory")
                continue
            lines.append(
                f"{name}: {p.label()}, batch {p.batch}, TTFT {p.ttft * 1e3:.0f} ms, TPOT "
                f"{p.tpot * 1e3:.1f} ms (p99 {p.tpot_p99 * 1e3:.1f}), {p.per_gpu:.2f} req/s/GPU "
                f"({p.tokens_per_s_per_gpu:.0f} tok/s/GPU)"
            )
        ref = [p for p in (self.af, self.colocated) if p is not None]
        if self.pd is not None and ref:
            best = max(ref, key=lambda p: p.per_gpu)
            gain = self.pd.per_gpu / best.per_gpu
            word = "beats" if gain > 1 else "does not beat"
            lines.append(f"PD+AF {word} the best single pool ({best.kind}): {gain:.2f}x goodput")
        return "\n".join(lines)


def compare(
    sim: Simulator,
    gpus: int,
    wl: Workload,
    space: PDSpace = PDSpace(),
    bandwidth: float | None = None,
) -> PDVerdict:
    """PD + AF against one AF pool and one colocated pool on ``gpus`` GPUs, under ``wl``'s
    TTFT and TPOT targets; ``bandwidth``: the KV link's bytes/s (default: the network's)."""
    from dataclasses import replace

    from splitmoe.sim.planner import af_deployments, colocated_deployments

    cs = replace(space.compare, batches=space.batches)
    pd = pd_plans(sim, wl, gpus, space, bandwidth)
    af = best_one_pool(sim, af_deployments(sim, gpus, cs), wl, gpus, space.batches)
    co = best_one_pool(sim, colocated_deployments(gpus, cs), wl, gpus, space.batches)
    return PDVerdict(
        pd[0] if pd else None,
        af[0] if af else None,
        co[0] if co else None,
        tuple(sorted(pd + af + co, key=lambda p: -p.per_gpu)),
    )


def table(plans: Iterable[ServingPlan], top: int = 10) -> str:
    head = (
        f"{'kind':<10}{'deployment':<76}{'GPUs':>5}{'batch':>6}{'TTFT ms':>9}{'TPOT ms':>9}"
        f"{'p99':>7}{'xfer ms':>8}{'req/s/GPU':>10}{'tok/s/GPU':>10}"
    )
    lines = [head]
    for p in list(plans)[:top]:
        lines.append(
            f"{p.kind:<10}{p.label():<76}{p.gpus:>5}{p.batch:>6}{p.ttft * 1e3:>9.0f}"
            f"{p.tpot * 1e3:>9.1f}{p.tpot_p99 * 1e3:>7.1f}{p.transfer_s * 1e3:>8.1f}"
            f"{p.per_gpu:>10.2f}{p.tokens_per_s_per_gpu:>10.0f}"
        )
    return "\n".join(lines)
