"""Published AF and EP results, simulated from their own setups (``scripts/plan.py --reproduce``).

Each case is a JSON file in ``splitmoe/sim/cases/`` naming its source (title, URL), the published
figure, the model config and hardware profile (the shipped ones: one set serves every case), the
deployment, and the workload the source states: batch per GPU, mean context, TPOT target, KV-cache
dtype, multi-token prediction. Nothing in a case corrects the simulator: a case only says what
was run. Kinds:

* ``throughput``: decode tokens/s per GPU. The batch is the source's (``batch``), Little's law
  on its throughput and per-user speed (``batch_from: "little"``), or the largest under
  ``tpot_slo_ms`` whose KV cache fits (the attention side's memory bound);
* ``ratio``: a disaggregated deployment's best tokens/s per GPU over a colocated baseline's, each
  searched under the same TPOT target (lists in ``deployment`` are searched), or each at the
  batch the source ran (``batch``, ``baseline_batch``);
* ``a2a``: dispatch and combine microseconds of GPU-initiated all-to-all at each EP size;
* ``a2a_budget``: a time budget for one layer's exchange (met when the prediction fits in it).

A figure is reproduced when the prediction is within ``TOLERANCE`` of it (budgets: at most it).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from splitmoe.sim.hardware import load_profile
from splitmoe.sim.imbalance import expert_load
from splitmoe.sim.model import ModelShape
from splitmoe.sim.simulator import DecodePrediction, Deployment, Simulator

CASE_DIR = Path(__file__).resolve().parent / "cases"
TOLERANCE = 0.25
# batches tried when a case gives a TPOT target instead of a batch: fine enough that the best
# is within a few percent of the true optimum
SEARCH_BATCHES = tuple(sorted({*range(1, 64), *range(64, 256, 8), *range(256, 2049, 16)}))


@dataclass(frozen=True)
class Row:
    case: str
    figure: str
    published: float
    predicted: float
    unit: str
    detail: str = ""
    budget: bool = False

    @property
    def ratio(self) -> float:
        return self.predicted / self.published

    @property
    def within(self) -> bool:
        if self.budget:
            return self.predicted <= self.published
        return abs(self.ratio - 1) <= TOLERANCE


def load_cases(directory: Path = CASE_DIR) -> list[dict]:
    cases = []
    for p in sorted(directory.glob("*.json")):
        case = json.loads(p.read_text())
        case["file"] = p.name
        for key in ("name", "source", "kind", "model", "hardware"):
            if key not in case:
                raise ValueError(f"{p}: a case needs {key!r}")
        if not case["source"].get("url"):
            raise ValueError(f"{p}: a case names its source (title and url)")
        cases.append(case)
    return cases


def simulator(case: dict) -> Simulator:
    mtp = case.get("mtp") or {}
    expert_hw = case.get("expert_hardware")
    return Simulator(
        ModelShape.from_config(case["model"]),
        load_profile(case["hardware"]),
        skew=float(case.get("skew", 0.0)),
        expert_hw=load_profile(expert_hw) if expert_hw else None,
        kv_bytes=int(case.get("kv_bytes", 2)),
        draft_tokens=int(mtp.get("draft_tokens", 0)),
        draft_acceptance=float(mtp.get("acceptance", 0.0)),
    )


def _deployments(spec: dict) -> list[Deployment]:
    """Every deployment a spec names (list values are searched)."""
    keys = list(spec)
    values = [v if isinstance(v, list) else [v] for v in spec.values()]
    out = []
    for combo in itertools.product(*values):
        d = dict(zip(keys, combo))
        if d.get("expert_ranks", 0) == 0 and "expert_parallel" not in d:
            d.setdefault("expert_parallel", 1)
        out.append(Deployment(**d))
    return out


def best_under_slo(
    sim: Simulator,
    dep: Deployment,
    context: float,
    tpot_slo: float | None,
    max_batch: int | None = None,
) -> DecodePrediction | None:
    """Highest tokens/s per GPU over batches whose KV cache fits and whose TPOT meets the
    target (every fitting batch without a target), at most ``max_batch`` (an engine's cap)."""
    limit = min(sim.max_batch(dep, context), max_batch or 10**9)
    best = None
    for b in SEARCH_BATCHES:
        if b > limit:
            break
        p = sim.decode(dep, b, context)
        if tpot_slo is not None and p.tpot > tpot_slo:
            break  # TPOT grows with the batch
        if best is None or p.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu:
            best = p
    return best


def _describe(p: DecodePrediction) -> str:
    d = p.deployment
    return (
        f"{d.label()}, batch {p.batch}, TPOT {p.tpot * 1e3:.1f} ms, bound by {p.binding}, "
        f"KV+weights {p.attention_mem_gb:.0f} GB"
    )


def _throughput_prediction(case: dict, sim: Simulator) -> DecodePrediction | None:
    ctx = float(case["context"])
    slo = case.get("tpot_slo_ms")
    slo = slo / 1e3 if slo else None
    best = None
    for dep in _deployments(case["deployment"]):
        if "batch" in case:
            p = sim.decode(dep, int(case["batch"]), ctx)
        elif case.get("batch_from") == "little":
            p = sim.decode(dep, round(case["published"] / case["per_user_tok_s"]), ctx)
        else:
            p = best_under_slo(sim, dep, ctx, slo, case.get("max_batch"))
        if p is not None and (best is None or p.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu):
            best = p
    return best


def evaluate(case: dict) -> list[Row]:
    """The rows of one case: published figures beside the simulator's predictions."""
    sim = simulator(case)
    kind = case["kind"]
    name = case["name"]
    if kind == "throughput":
        p = _throughput_prediction(case, sim)
        if p is None:
            return [Row(name, "tok/s/GPU", case["published"], 0.0, case["unit"], "no batch fits")]
        detail = _describe(p)
        if not p.fits:
            detail += " (does not fit in memory)"
        return [Row(name, "tok/s/GPU", case["published"], p.tokens_per_s_per_gpu, case["unit"],
                    detail)]  # fmt: skip
    if kind == "ratio":
        p = _throughput_prediction(case, sim)
        cap = case.get("baseline_max_batch")
        base_case = {**case, "deployment": case["baseline"], "max_batch": cap}
        if "baseline_batch" in case:  # the baseline ran its own measured batch
            base_case["batch"] = case["baseline_batch"]
        base = _throughput_prediction(base_case, sim)
        if p is None or base is None:
            return [Row(name, "AF / colocated", case["published"], 0.0, case["unit"], "no plan")]
        detail = (
            f"AF {p.tokens_per_s_per_gpu:.0f} tok/s/GPU ({_describe(p)}); colocated "
            f"{base.tokens_per_s_per_gpu:.0f} ({_describe(base)})"
        )
        if cap:
            free = _throughput_prediction({**base_case, "max_batch": None}, sim)
            if free is not None:
                detail += (
                    f"; without the baseline's {cap}-sequence cap it reaches "
                    f"{free.tokens_per_s_per_gpu:.0f} (batch {free.batch}): AF / colocated "
                    f"{p.tokens_per_s_per_gpu / free.tokens_per_s_per_gpu:.2f}x"
                )
        ratio = p.tokens_per_s_per_gpu / base.tokens_per_s_per_gpu
        return [Row(name, "AF / colocated", case["published"], ratio, case["unit"], detail)]
    if kind == "a2a":
        m = sim.model
        rows = []
        for pt in case["points"]:
            ep = int(pt["ep"])
            g = min(sim.hw.gpus_per_node, ep)
            load = expert_load(case["tokens"] * ep, m.num_experts, m.top_k, ep)
            d, c = sim.gpu_a2a_times(case["tokens"] * m.top_k, load.pairs_max, 1 - g / ep,
                                     (g - 1) / ep)  # fmt: skip
            for op, t in (("dispatch", d), ("combine", c)):
                rows.append(Row(name, f"{op} EP{ep}", pt[op], t * 1e6, case["unit"]))
        return rows
    if kind == "a2a_budget":
        p = _throughput_prediction(case, sim)
        if p is None:
            return [Row(name, "A<->F per layer", case["published"], 0.0, case["unit"], "no plan")]
        mb = max(1, min(p.deployment.micro_batches, p.batch))
        per_mb = p.step.t_comm / mb
        return [Row(name, "A<->F per layer", case["published"], per_mb * 1e6, case["unit"],
                    f"one micro-batch of {p.batch // mb} sequences x {p.deployment.attention_ranks}"
                    f" attention GPUs, {_describe(p)}", budget=True)]  # fmt: skip
    raise ValueError(f"{case['file']}: unknown kind {kind!r}")


def reproduce(cases: list[dict] | None = None) -> list[Row]:
    return [row for case in (cases or load_cases()) for row in evaluate(case)]


def table(rows: list[Row], details: bool = True) -> str:
    head = f"{'published result':<58}{'figure':<18}{'published':>11}{'predicted':>11}{'ratio':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        mark = "" if r.within else "  MISS"
        pub = f"<= {r.published:g}" if r.budget else f"{r.published:g}"
        lines.append(
            f"{r.case[:57]:<58}{r.figure:<18}{pub:>11}{r.predicted:>11.4g}{r.ratio:>7.2f}{mark}"
        )
        if details and r.detail:
            lines.append(f"    {r.detail}")
    n = sum(r.within for r in rows)
    lines.append(f"reproduced: {n}/{len(rows)} within ±{TOLERANCE:.0%}")
    return "\n".join(lines)
