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
from collections.abc import Iterable
from dataclasses import dataclass

from splitmoe.sim.simulator import DecodePrediction, Deployment, Simulator

BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass(frozen=True)
class SearchSpace:
    attention_ranks: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
    expert_ranks: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    micro_batches: tuple[int, ...] = (1, 2, 3, 4)
    transports: tuple[str, ...] = ("flat", "two_phase", "auto")
    # (balancer, redundant experts as a multiple of E): static, and EPLB-style with 1 or 2
    # extra slots per expert rank
    balancers: tuple[tuple[str, int], ...] = (("static", 0), ("global", 1), ("global", 2))
    colocated_sizes: tuple[int, ...] = (8, 16, 32, 64, 128)
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
                if tr != "flat" and size <= sim.hw.gpus_per_node:
                    continue  # one node: every scheme is the flat one
                dep = Deployment(a, e, m, tr, bal, red, replicas)
                p = best_batch(sim, dep, tpot_slo, context, space.batches)
                if p is not None:
                    disagg.append(Plan(p, gpus))
    colocated: list[Plan] = []
    for size, m in itertools.product(space.colocated_sizes, space.micro_batches[:2]):
        if size > gpus:
            continue
        for bal, per_rank in space.balancers:
            dep = Deployment(size, 0, m, "flat", bal, per_rank * size, gpus // size, size)
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
