"""A:E planner: the deployment with the highest decode throughput per GPU under a TPOT target.

For a GPU budget it searches attention ranks ``A`` and expert ranks ``E`` per instance (replicas
fill the budget), micro-batches, transport, balancer with redundant experts, and the batch per
attention rank; each candidate is scored by `Simulator.decode`. Per setting, the batch grows
until the TPOT target or memory is exceeded (throughput per GPU rises with batch below the
target), so the search is a few thousand simulator calls. The colocated baseline — experts
sharded over the instance's own GPUs (DeepSeek-style EP with attention data-parallel) — is
searched the same way.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from splitmoe.sim.simulator import DecodePrediction, Deployment, Simulator

BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass(frozen=True)
class SearchSpace:
    attention_ranks: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
    expert_ranks: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    micro_batches: tuple[int, ...] = (1, 2, 3, 4)
    transports: tuple[str, ...] = ("flat", "two_phase", "auto", "gpu_a2a")
    # (balancer, redundant experts as a multiple of E): static, and EPLB-style with 1 or 2
    # extra slots per expert rank
    balancers: tuple[tuple[str, int], ...] = (("static", 0), ("global", 1), ("global", 2))
    colocated_sizes: tuple[int, ...] = (8, 16, 32, 64, 128)
    colocated_transports: tuple[str, ...] = ("flat", "gpu_a2a")
    batches: tuple[int, ...] = BATCHES


@dataclass(frozen=True)
class Plan:
    prediction: DecodePrediction
    gpus_budget: int

    @property
    def per_gpu(self) -> float:
        """Throughput per GPU of the whole budget (idle GPUs count)."""
        return self.prediction.tokens_per_s / self.gpus_budget


def best_batch(
    sim: Simulator, dep: Deployment, tpot_slo: float, context: float, batches: Iterable[int]
) -> DecodePrediction | None:
    """Largest-throughput batch meeting the TPOT target and memory (None if none does)."""
    best = None
    for b in batches:
        p = sim.decode(dep, b, context)
        if not p.fits or p.tpot > tpot_slo:
            if best is not None or not p.fits:
                break
            continue
        if best is None or p.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu:
            best = p
    return best


def _experts_fit(sim: Simulator, e: int, redundant: int) -> bool:
    bal = "global" if redundant else "static"
    dep = Deployment(1, e, redundant_experts=redundant, balancer=bal)
    _, exp_gb = sim.memory_gb(dep, 0, 0)
    return exp_gb <= sim.hw.memory_bytes / 1e9 * 0.9


def search(
    sim: Simulator,
    gpus: int,
    tpot_slo: float,
    context: float,
    space: SearchSpace = SearchSpace(),
) -> tuple[list[Plan], list[Plan]]:
    """(disaggregated plans, colocated plans), each sorted best first (throughput per GPU)."""
    disagg: list[Plan] = []
    experts = sim.model.num_experts
    for e, (bal, per_rank) in itertools.product(space.expert_ranks, space.balancers):
        red = per_rank * e
        if e > experts or not _experts_fit(sim, e, red):
            continue
        for a in space.attention_ranks:
            size = a + e
            if size > gpus:
                continue
            replicas = gpus // size
            for m, tr in itertools.product(space.micro_batches, space.transports):
                if tr in ("two_phase", "auto") and size <= sim.hw.gpus_per_node:
                    continue  # one node: every host-issued scheme is the flat one
                dep = Deployment(a, e, m, tr, bal, red, replicas)
                p = best_batch(sim, dep, tpot_slo, context, space.batches)
                if p is not None:
                    disagg.append(Plan(p, gpus))
    colocated: list[Plan] = []
    for size, m, tr in itertools.product(
        space.colocated_sizes, space.micro_batches[:2], space.colocated_transports
    ):
        if size > gpus:
            continue
        for bal, per_rank in space.balancers:
            dep = Deployment(size, 0, m, tr, bal, per_rank * size, gpus // size, size)
            p = best_batch(sim, dep, tpot_slo, context, space.batches)
            if p is not None:
                colocated.append(Plan(p, gpus))
    disagg.sort(key=lambda p: -p.per_gpu)
    colocated.sort(key=lambda p: -p.per_gpu)
    return disagg, colocated


def table(plans: list[Plan], title: str, top: int = 8) -> str:
    head = (
        f"{title:<38}{'GPUs':>6}{'batch':>7}{'TPOT ms':>9}{'tok/s/GPU':>11}{'attn':>7}"
        f"{'expert':>8}{'comm':>7}{'ovlp':>6}{'imbal':>7}{'mem A/E GB':>12}"
    )
    lines = [head]
    seen = set()
    for plan in plans:
        p = plan.prediction
        d = p.deployment
        # "auto" that always picks one scheme predicts exactly what that scheme does: list once
        key = (d.attention_ranks, d.expert_ranks, d.micro_batches, d.balancer,
               d.redundant_experts, d.replicas, p.batch, round(p.tpot, 9))  # fmt: skip
        if key in seen:
            continue
        seen.add(key)
        if len(seen) > top:
            break
        st = p.step
        used = f"{d.gpus}" if d.gpus == plan.gpus_budget else f"{d.gpus}/{plan.gpus_budget}"
        lines.append(
            f"{d.label() + f' x{d.replicas}':<38}{used:>6}{p.batch:>7}{p.tpot * 1e3:>9.1f}"
            f"{plan.per_gpu:>11.0f}{st.t_attn * 1e3:>7.2f}{st.t_expert * 1e3:>8.2f}"
            f"{st.t_comm * 1e3:>7.2f}{st.overlap_saved:>6.0%}{st.imbalance:>7.2f}"
            f"{p.attention_mem_gb:>6.0f}/{p.expert_mem_gb:<5.0f}"
        )
    return "\n".join(lines)


# ---- what a researcher asks: fronts, ratios, verdicts, crossovers ------------------------------
def pareto_front(points: list[DecodePrediction]) -> list[DecodePrediction]:
    """The non-dominated points (lower TPOT, higher tokens/s per GPU), by increasing TPOT; along
    the front throughput per GPU strictly increases."""
    front: list[DecodePrediction] = []
    for p in sorted(points, key=lambda p: (p.tpot, -p.tokens_per_s_per_gpu)):
        if not front or p.tokens_per_s_per_gpu > front[-1].tokens_per_s_per_gpu:
            front.append(p)
    return front


def sweep_points(
    sim: Simulator, deps: Iterable[Deployment], context: float, batches: Iterable[int] = BATCHES
) -> list[DecodePrediction]:
    """Every (deployment, batch) that fits in memory, for a throughput-latency plot."""
    out = []
    for dep in deps:
        limit = sim.max_batch(dep, context)
        for b in batches:
            if b > limit:
                break
            out.append(sim.decode(dep, b, context))
    return out


@dataclass(frozen=True)
class CompareSpace:
    """A small space for verdicts and sweeps (hundreds of simulator calls, not thousands): AF
    instances of ``A + E`` GPUs, colocated EP instances with one or two micro-batches, both with
    GPU-initiated all-to-all."""

    attention_ranks: tuple[int, ...] = (4, 8, 12, 16, 24, 32, 48)
    expert_ranks: tuple[int, ...] = (4, 8, 16, 32)
    micro_batches: tuple[int, ...] = (2, 3)
    colocated_sizes: tuple[int, ...] = (8, 16, 32, 64)
    # one micro-batch or two: two re-read every expert's weights per step, which loses where
    # weight reads bind (the model's Mixtral-8x22B on H100: EP16 m=1 serves more than twice
    # EP8 m=2's tokens per GPU)
    colocated_micro_batches: tuple[int, ...] = (1, 2)
    transport: str = "gpu_a2a"
    batches: tuple[int, ...] = (8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384,
                                448, 512, 640, 768, 896, 1024)  # fmt: skip


def binding(
    sim: Simulator, p: DecodePrediction, batches: Iterable[int] = CompareSpace.batches
) -> str:
    """What stops this plan from growing its batch: the KV cache filling the attention GPU's
    memory (the next batch tried would not fit), else the part of the step that takes longest
    (attention, experts, communication)."""
    bigger = [b for b in batches if b > p.batch]
    if p.batch >= sim.max_batch(p.deployment, p.context) or (
        bigger and min(bigger) > sim.max_batch(p.deployment, p.context)
    ):
        return "KV memory"
    return p.binding


def af_deployments(sim: Simulator, gpus: int, space: CompareSpace) -> list[Deployment]:
    out = []
    for a, e, m in itertools.product(space.attention_ranks, space.expert_ranks,
                                     space.micro_batches):  # fmt: skip
        if a + e <= gpus and e <= sim.model.num_experts and _experts_fit(sim, e, 0):
            out.append(Deployment(a, e, m, space.transport, replicas=gpus // (a + e)))
    return out


def colocated_deployments(gpus: int, space: CompareSpace) -> list[Deployment]:
    return [
        Deployment(n, 0, m, space.transport, replicas=gpus // n, expert_parallel=n)
        for n in space.colocated_sizes
        for m in space.colocated_micro_batches
        if n <= gpus
    ]


def best_of(
    sim: Simulator, deps: list[Deployment], tpot_slo: float, context: float, gpus: int,
    batches: Iterable[int],
) -> Plan | None:  # fmt: skip
    best = None
    for dep in deps:
        p = best_batch(sim, dep, tpot_slo, context, batches)
        if p is not None and (best is None or p.tokens_per_s / gpus > best.per_gpu):
            best = Plan(p, gpus)
    return best


@dataclass(frozen=True)
class Verdict:
    af: Plan | None
    colocated: Plan | None

    @property
    def gain(self) -> float:
        """AF tokens/s per GPU over colocated (0 when AF has no plan, inf when colocated has
        none)."""
        if self.af is None:
            return 0.0
        if self.colocated is None:
            return math.inf
        return self.af.per_gpu / self.colocated.per_gpu

    def text(self, sim: Simulator) -> str:
        lines = []
        for name, plan in (("AF", self.af), ("colocated", self.colocated)):
            if plan is None:
                lines.append(f"{name}: no deployment meets the TPOT target within memory")
                continue
            p = plan.prediction
            lines.append(
                f"{name}: {p.deployment.label()} x{p.deployment.replicas}, batch {p.batch}, "
                f"TPOT {p.tpot * 1e3:.1f} ms, {plan.per_gpu:.0f} tok/s/GPU; bound by "
                f"{binding(sim, p)} (per MoE layer: attention {p.step.t_attn * 1e3:.2f}, "
                f"experts {p.step.t_expert * 1e3:.2f}, communication {p.step.t_comm * 1e3:.2f} ms)"
            )
        if self.af is None and self.colocated is None:
            lines.append("neither meets the target: relax the TPOT target or add GPUs")
            return "\n".join(lines)
        g = self.gain
        word = "beats" if g > 1.0 else "does not beat"
        lines.append(f"AF {word} colocated: {g:.2f}x throughput per GPU")
        return "\n".join(lines)


def verdict(
    sim: Simulator, gpus: int, tpot_slo: float, context: float, space: CompareSpace = CompareSpace()
) -> Verdict:
    """Best AF and best colocated plan under the TPOT target, in the small space."""
    af = best_of(sim, af_deployments(sim, gpus, space), tpot_slo, context, gpus, space.batches)
    co = best_of(sim, colocated_deployments(gpus, space), tpot_slo, context, gpus, space.batches)
    return Verdict(af, co)


def ae_ratio_sweep(
    sim: Simulator, expert_ranks: int, attention_ranks: Iterable[int], tpot_slo: float,
    context: float, micro_batches: int = 3, transport: str = "gpu_a2a",
    batches: Iterable[int] = CompareSpace.batches,
) -> list[tuple[int, Plan | None]]:  # fmt: skip
    """Best plan per A for a fixed E (one instance): tokens/s per GPU against A:E."""
    out = []
    for a in attention_ranks:
        dep = Deployment(a, expert_ranks, micro_batches, transport)
        p = best_batch(sim, dep, tpot_slo, context, batches)
        out.append((a, Plan(p, dep.gpus) if p else None))
    return out


def closed_form_ratio(
    sim: Simulator, expert_ranks: int, batch: int, context: float, micro_batches: int = 3,
    transport: str = "gpu_a2a",
) -> float:  # fmt: skip
    """The A:E ratio past which the FFN side binds, from the same per-layer costs (derived here,
    with the structure of arXiv 2601.21351's rule for rA-1F bundles, r* = max(r_A, r_C,
    r_peak)): with ``batch`` sequences per attention GPU, the expert ranks' time is flat while
    they only read weights (their floor: every local expert read once per micro-batch) and
    grows once the aggregated tokens make them compute- or link-bound. Grow A while the
    experts' and the links' time per layer stays under max(attention's time, one attention
    GPU's own exchange time at A = 1, the experts' floor): below this ratio the attention side
    binds and more A is free throughput; above it A idles waiting for the FFN side."""

    def step(a: int):
        return sim.step(Deployment(a, expert_ranks, micro_batches, transport), batch, context)

    one = step(1)
    per_rank = math.ceil(sim.model.num_experts / expert_ranks)
    floor = micro_batches * sim._experts(1.0, per_rank)  # every local expert's weights, read
    # the attention GPU's own pace: its attention, or its NIC's egress (which does not grow with
    # A), or the experts' weight reads
    limit = max(one.t_attn, one.t_comm, floor)
    lo, hi = 1, 4096
    while lo < hi:  # the largest A whose expert and link time stay under the limit
        mid = (lo + hi + 1) // 2
        st = step(mid)
        if max(st.t_expert, st.t_comm) <= limit * 1.02:
            lo = mid
        else:
            hi = mid - 1
    return lo / expert_ranks


CROSSOVER_PARAMS = ("bandwidth", "context", "sparsity")


def vary(sim: Simulator, param: str, value: float, context: float) -> tuple[Simulator, float]:
    """``sim`` and ``context`` with one parameter changed: ``bandwidth`` scales the network
    (inter-node) link's bytes/s by ``value``; ``context`` sets the mean context; ``sparsity``
    sets the routed experts to ``top_k / value`` at the same top-k and the same total expert
    parameters (fewer, larger experts: coarser and denser; more, smaller: finer and sparser)."""
    from dataclasses import replace

    if param == "bandwidth":
        links = sim.hw.links
        inter = replace(links.inter, bytes_per_s=links.inter.bytes_per_s * value)
        return replace(sim, hw=replace(sim.hw, links=replace(links, inter=inter))), context
    if param == "context":
        return sim, float(value)
    if param == "sparsity":
        m = sim.model
        experts = max(m.top_k, round(m.top_k / value))
        inter = round(m.moe_intermediate * m.num_experts / experts)
        return replace(sim, model=replace(m, num_experts=experts, moe_intermediate=inter)), context
    raise ValueError(f"unknown crossover parameter {param!r}: use one of {CROSSOVER_PARAMS}")


def crossover(
    sim: Simulator, param: str, values: Iterable[float], gpus: int, tpot_slo: float,
    context: float, space: CompareSpace = CompareSpace(),
) -> list[tuple[float, Verdict]]:  # fmt: skip
    """The AF-vs-colocated verdict as one parameter varies (see `vary`)."""
    out = []
    for v in values:
        s, ctx = vary(sim, param, v, context)
        out.append((v, verdict(s, gpus, tpot_slo, ctx, space)))
    return out


# ---- where AF wins, across models and GPUs ----------------------------------------------------
MATRIX_MODELS = ("deepseek-v3", "qwen3-235b-a22b", "mixtral-8x22b")  # fine, mid, coarse experts
MATRIX_HARDWARE = ("h100", "h200", "h800", "gb200")
NIC_SCALES = (0.5, 1.0, 2.0)
EP_WIDTHS = (4, 16, 64)


@dataclass(frozen=True)
class MatrixCell:
    """One model on one GPU: the verdict, AF / colocated as the NIC's bandwidth is scaled
    (``by_nic``: (scale, gain)), and the same AF plan over a colocated baseline held to one EP
    width (``by_ep``: (width, gain); 0 where the width has no plan)."""

    model: str
    hardware: str
    verdict: Verdict
    af_bound: str  # what stops the AF plan's batch from growing (`binding`)
    colocated_bound: str
    by_nic: tuple[tuple[float, float], ...]
    by_ep: tuple[tuple[int, float], ...]


def verdict_matrix(
    models: Iterable[str] = MATRIX_MODELS,
    hardware: Iterable[str] = MATRIX_HARDWARE,
    gpus: int = 64,
    tpot_slo: float = 0.05,
    context: float = 4096,
    skew: float = 0.3,
    nic_scales: Iterable[float] = NIC_SCALES,
    ep_widths: Iterable[int] = EP_WIDTHS,
    space: CompareSpace = CompareSpace(),
) -> list[MatrixCell]:
    """`verdict` for every model on every GPU, with its NIC-bandwidth and EP-width sweeps."""
    from dataclasses import replace

    from splitmoe.sim.hardware import load_profile
    from splitmoe.sim.model import ModelShape

    cells = []
    for name in models:
        shape = ModelShape.from_config(name)
        for hw in hardware:
            sim = Simulator(shape, load_profile(hw), skew=skew)
            v = verdict(sim, gpus, tpot_slo, context, space)
            by_nic = tuple(
                (k, v.gain if k == 1 else verdict(vary(sim, "bandwidth", k, context)[0], gpus,
                                                  tpot_slo, context, space).gain)
                for k in nic_scales
            )  # fmt: skip
            by_ep = []
            for w in ep_widths:
                narrow = replace(space, colocated_sizes=(w,))
                co = best_of(sim, colocated_deployments(gpus, narrow), tpot_slo, context, gpus,
                             space.batches)  # fmt: skip
                by_ep.append((w, Verdict(v.af, co).gain if co is not None else 0.0))
            ab = binding(sim, v.af.prediction) if v.af else "-"
            cb = binding(sim, v.colocated.prediction) if v.colocated else "-"
            cells.append(MatrixCell(name, hw, v, ab, cb, by_nic, tuple(by_ep)))
    return cells


def matrix_table(cells: list[MatrixCell]) -> str:
    """One line per (model, GPU): both sides' tokens/s per GPU, the gain, what binds AF, and the
    gain under each NIC scale and each colocated EP width."""
    if not cells:
        return ""
    nic = "".join(f"{f'NIC x{k:g}':>10}" for k, _ in cells[0].by_nic)
    ep = "".join(f"{f'vs EP{w}':>9}" for w, _ in cells[0].by_ep)
    head = (
        f"{'model':<18}{'GPU':<7}{'AF':>7}{'coloc':>7}{'AF/co':>7}  {'AF bound by':<15}"
        f"{'coloc bound by':<15}{nic}{ep}"
    )
    lines = [head]

    def gain(g: float, width: int) -> str:
        return f"{g:>{width}.2f}" if g > 0 else f"{'-':>{width}}"

    for c in cells:
        v = c.verdict
        af = v.af.per_gpu if v.af else 0.0
        co = v.colocated.per_gpu if v.colocated else 0.0
        lines.append(
            f"{c.model:<18}{c.hardware:<7}{af:>7.0f}{co:>7.0f}{gain(v.gain, 7)}  "
            f"{c.af_bound:<15}{c.colocated_bound:<15}"
            + "".join(gain(g, 10) for _, g in c.by_nic)
            + "".join(gain(g, 9) for _, g in c.by_ep)
        )
    return "\n".join(lines)
