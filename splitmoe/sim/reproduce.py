"""Published AF and EP results, simulated from their own setups (``scripts/plan.py --reproduce``).

Each case is a JSON file in ``splitmoe/sim/cases/``. It names its source (title, URL, the table,
figure or section, the figure as printed, and how far it could be checked), and splits what it
uses into three parts:

* ``from_source``: what the source states as its setup (hardware, model, SLO, context, the
  baseline's parallelism, a batch only where the source ran a stated batch), each with where
  the source says it;
* ``assumed``: what the source does not state that the case still needs, each said as such;
* ``predicts``: what the simulator chooses itself: batch sizes, A:F ratios and micro-batch
  counts come out of the planner's search under the case's SLO and memory (lists in
  ``deployment`` are searched), never from the source.

A key the simulator is meant to predict (``batch``, ``baseline_batch``, ``max_batch``,
``baseline_max_batch``) is refused unless ``from_source`` gives it a citation, and a ``ratio``
case may not fix a batch at all: its gain is the planner's best on each side. Kinds:

* ``throughput``: decode tokens/s per GPU, at the source's stated batch (``batch``), at the
  batch Little's law gives from the source's throughput and per-user speed
  (``batch_from: "little"``: the row then checks the step time), or at the planner's best batch
  under ``tpot_slo_ms`` whose KV cache fits;
* ``ratio``: a disaggregated deployment's best tokens/s per GPU over a colocated baseline's, each
  searched under the TPOT target (``"tpot_slo_ms": "baseline"``: the disaggregated side must be
  no slower per token than the baseline's best, itself searched without a target);
* ``a2a``: dispatch and combine microseconds of GPU-initiated all-to-all at each EP size;
* ``a2a_budget``: a time budget for one layer's exchange (met when the prediction fits in it).

``role`` says what a case's rows may show: ``prediction`` (the default: counted),
``calibration`` (a profile constant was read off these figures: they cannot test it) or
``consistency`` (the figure follows from another case's prediction). Only prediction rows count
towards ``reproduced``; the others are printed and marked. A figure is reproduced when the
prediction is within ``TOLERANCE`` of it (budgets: at most it); a case when all its rows are.
`sensitivity` repeats the count with one hardware constant scaled at a time.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

from splitmoe.sim.hardware import HardwareProfile, Overheads, load_profile
from splitmoe.sim.imbalance import expert_load
from splitmoe.sim.model import ModelShape
from splitmoe.sim.simulator import DecodePrediction, Deployment, Simulator

CASE_DIR = Path(__file__).resolve().parent / "cases"
TOLERANCE = 0.25
ROLES = ("prediction", "calibration", "consistency")
# what the simulator is meant to predict: a case may take one only where its source ran it
PREDICTED_KEYS = ("batch", "baseline_batch", "max_batch", "baseline_max_batch")
# batches tried when a case gives a TPOT target instead of a batch: fine enough that the best
# is within a few percent of the true optimum
SEARCH_BATCHES = tuple(sorted({*range(1, 64), *range(64, 256, 8), *range(256, 2049, 16)}))
Vary = Callable[[HardwareProfile], HardwareProfile]


@dataclass(frozen=True)
class Row:
    case: str
    figure: str
    published: float
    predicted: float
    unit: str
    detail: str = ""
    budget: bool = False
    role: str = "prediction"
    case_id: str = ""  # the case file's stem

    @property
    def ratio(self) -> float:
        return self.predicted / self.published

    @property
    def within(self) -> bool:
        if self.budget:
            return self.predicted <= self.published
        return abs(self.ratio - 1) <= TOLERANCE

    @property
    def counted(self) -> bool:
        """Whether the row tests the simulator (calibration and consistency rows do not)."""
        return self.role == "prediction"


@dataclass(frozen=True)
class Count:
    """Counted cases and rows, and how many of each are within the tolerance."""

    cases_within: int
    cases: int
    rows_within: int
    rows: int
    missed: tuple[str, ...] = ()  # ids of the counted cases not within

    def text(self) -> str:
        return (
            f"reproduced: {self.cases_within}/{self.cases} cases ({self.rows_within}/{self.rows} "
            f"rows) within ±{TOLERANCE:.0%}"
        )


def count(rows: list[Row]) -> Count:
    """Prediction rows only; a case is within when every one of its rows is."""
    by_case: dict[str, list[Row]] = {}
    for r in rows:
        if r.counted:
            by_case.setdefault(r.case, []).append(r)
    return Count(
        cases_within=sum(all(r.within for r in rs) for rs in by_case.values()),
        cases=len(by_case),
        rows_within=sum(r.within for rs in by_case.values() for r in rs),
        rows=sum(len(rs) for rs in by_case.values()),
        missed=tuple(
            rs[0].case_id or c for c, rs in by_case.items() if not all(r.within for r in rs)
        ),
    )


def _check_case(case: dict, p: Path) -> None:
    for key in ("name", "source", "kind", "model", "hardware", "from_source", "predicts"):
        if key not in case:
            raise ValueError(f"{p}: a case needs {key!r}")
    src = case["source"]
    if not src.get("url") or not src.get("title"):
        raise ValueError(f"{p}: a case names its source (title and url)")
    for key in ("where", "figure", "checked"):
        if not src.get(key):
            raise ValueError(
                f"{p}: source.{key} missing: a case cites the table or figure ('where'), the "
                "number as printed ('figure') and how far it was checked ('checked')"
            )
    slo = case.get("tpot_slo_ms")
    if slo is not None and not isinstance(slo, (int, float)):
        if slo != "baseline" or case["kind"] != "ratio":
            raise ValueError(
                f"{p}: tpot_slo_ms={slo!r}: milliseconds, or 'baseline' in a ratio case"
            )
    role = case.setdefault("role", "prediction")
    if role not in ROLES:
        raise ValueError(f"{p}: role {role!r} must be one of {ROLES}")
    for key in PREDICTED_KEYS:
        if key not in case:
            continue
        if case["kind"] == "ratio":
            raise ValueError(
                f"{p}: a ratio case may not fix {key!r}: both sides' batches are the planner's "
                "own search under the case's SLO and memory"
            )
        if key not in case["from_source"]:
            raise ValueError(
                f"{p}: {key!r} is what the simulator predicts: drop it, or cite in "
                "from_source where the source states it as its setup"
            )


def load_cases(directory: Path = CASE_DIR) -> list[dict]:
    cases = []
    for p in sorted(directory.glob("*.json")):
        case = json.loads(p.read_text())
        case["file"] = p.name
        _check_case(case, p)
        cases.append(case)
    return cases


def simulator(case: dict, vary: Vary | None = None) -> Simulator:
    """The case's simulator; ``vary`` changes every hardware profile it uses (`sensitivity`)."""
    mtp = case.get("mtp") or {}
    vary = vary or (lambda hw: hw)
    expert_hw = case.get("expert_hardware")
    return Simulator(
        ModelShape.from_config(case["model"]),
        vary(load_profile(case["hardware"])),
        skew=float(case.get("skew", 0.0)),
        expert_hw=vary(load_profile(expert_hw)) if expert_hw else None,
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


def _best(
    case: dict, sim: Simulator, spec: dict, tpot_slo: float | None, batch_key: str = "batch"
) -> DecodePrediction | None:
    """The best prediction over the deployments ``spec`` names: at the case's stated batch,
    Little's law's, or the planner's best under ``tpot_slo`` (seconds) within memory."""
    ctx = float(case["context"])
    best = None
    for dep in _deployments(spec):
        if batch_key in case:
            p = sim.decode(dep, int(case[batch_key]), ctx)
        elif case.get("batch_from") == "little":
            p = sim.decode(dep, round(case["published"] / case["per_user_tok_s"]), ctx)
        else:
            p = best_under_slo(sim, dep, ctx, tpot_slo, case.get("max_batch"))
        if p is not None and (best is None or p.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu):
            best = p
    return best


def _slo_s(case: dict) -> float | None:
    slo = case.get("tpot_slo_ms")
    return slo / 1e3 if isinstance(slo, (int, float)) else None


def evaluate(case: dict, vary: Vary | None = None) -> list[Row]:
    """The rows of one case: published figures beside the simulator's predictions."""
    case_id = Path(case.get("file", "")).stem
    return [replace(r, case_id=case_id) for r in _evaluate(case, simulator(case, vary))]


def _evaluate(case: dict, sim: Simulator) -> list[Row]:
    kind = case["kind"]
    name = case["name"]
    role = case.get("role", "prediction")
    if kind == "throughput":
        p = _best(case, sim, case["deployment"], _slo_s(case))
        if p is None:
            return [Row(name, "tok/s/GPU", case["published"], 0.0, case["unit"], "no batch fits",
                        role=role)]  # fmt: skip
        detail = _describe(p)
        if not p.fits:
            detail += " (does not fit in memory)"
        return [Row(name, "tok/s/GPU", case["published"], p.tokens_per_s_per_gpu, case["unit"],
                    detail, role=role)]  # fmt: skip
    if kind == "ratio":
        # the baseline first: with "tpot_slo_ms": "baseline" the AF side must match its TPOT
        base = _best(case, sim, case["baseline"], _slo_s(case))
        af_slo = _slo_s(case)
        if case.get("tpot_slo_ms") == "baseline":
            af_slo = base.tpot if base is not None else None
        p = _best(case, sim, case["deployment"], af_slo)
        if p is None or base is None:
            return [Row(name, "AF / colocated", case["published"], 0.0, case["unit"], "no plan",
                        role=role)]  # fmt: skip
        detail = (
            f"AF {p.tokens_per_s_per_gpu:.0f} tok/s/GPU ({_describe(p)}); colocated "
            f"{base.tokens_per_s_per_gpu:.0f} ({_describe(base)})"
        )
        ratio = p.tokens_per_s_per_gpu / base.tokens_per_s_per_gpu
        return [Row(name, "AF / colocated", case["published"], ratio, case["unit"], detail,
                    role=role)]  # fmt: skip
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
                rows.append(Row(name, f"{op} EP{ep}", pt[op], t * 1e6, case["unit"], role=role))
        return rows
    if kind == "a2a_budget":
        p = _best(case, sim, case["deployment"], _slo_s(case))
        if p is None:
            return [Row(name, "A<->F per layer", case["published"], 0.0, case["unit"], "no plan",
                        budget=True, role=role)]  # fmt: skip
        mb = max(1, min(p.deployment.micro_batches, p.batch))
        per_mb = p.step.t_comm / mb
        return [Row(name, "A<->F per layer", case["published"], per_mb * 1e6, case["unit"],
                    f"one micro-batch of {p.batch // mb} sequences x {p.deployment.attention_ranks}"
                    f" attention GPUs, {_describe(p)}", budget=True, role=role)]  # fmt: skip
    raise ValueError(f"{case['file']}: unknown kind {kind!r}")


def reproduce(cases: list[dict] | None = None, vary: Vary | None = None) -> list[Row]:
    return [row for case in (cases or load_cases()) for row in evaluate(case, vary)]


def table(rows: list[Row], details: bool = True) -> str:
    head = f"{'published result':<58}{'figure':<18}{'published':>11}{'predicted':>11}{'ratio':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if not r.counted:
            mark = f"  ({r.role}: not counted)"
        else:
            mark = "" if r.within else "  MISS"
        pub = f"<= {r.published:g}" if r.budget else f"{r.published:g}"
        lines.append(
            f"{r.case[:57]:<58}{r.figure:<18}{pub:>11}{r.predicted:>11.4g}{r.ratio:>7.2f}{mark}"
        )
        if details and r.detail:
            lines.append(f"    {r.detail}")
    lines.append(count(rows).text())
    aside: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        if not r.counted:
            aside.setdefault((r.role, r.case), []).append(r)
    for (role, case), rs in aside.items():
        lines.append(
            f"not counted ({role}): {case}: {sum(r.within for r in rs)}/{len(rs)} rows within"
        )
    return "\n".join(lines)


# ---- sensitivity: what the published figures pin down ------------------------------------------
def _scale_overheads(oh: Overheads, k: float) -> Overheads:
    values = {}
    for f in fields(oh):
        v = getattr(oh, f.name)
        values[f.name] = tuple(x * k for x in v) if isinstance(v, tuple) else v * k
    return Overheads(**values)


def _scale_links(hw: HardwareProfile, k: float, which: str, attr: str) -> HardwareProfile:
    links = hw.links
    link = getattr(links, which)
    new = replace(link, **{attr: getattr(link, attr) * k})
    return replace(hw, links=replace(links, **{which: new}))


# each hardware constant a case's figures could pin down, as a function scaling it by k; the
# efficiencies multiply the peaks everywhere they are used, so scaling a peak is scaling what a
# kernel achieves (an efficiency above 1 would be refused)
CONSTANTS: dict[str, Callable[[HardwareProfile, float], HardwareProfile]] = {
    "GEMM FLOP/s": lambda hw, k: replace(
        hw, peak_flops=hw.peak_flops * k, fp8_flops=hw.fp8_flops * k
    ),
    "HBM bytes/s": lambda hw, k: replace(hw, mem_bytes_per_s=hw.mem_bytes_per_s * k),
    "GPU memory": lambda hw, k: replace(hw, memory_bytes=hw.memory_bytes * k),
    "NVLink bytes/s": lambda hw, k: _scale_links(hw, k, "intra", "bytes_per_s"),
    "NIC bytes/s": lambda hw, k: _scale_links(hw, k, "inter", "bytes_per_s"),
    "link alpha": lambda hw, k: _scale_links(
        _scale_links(hw, k, "intra", "alpha_s"), k, "inter", "alpha_s"
    ),
    "a2a call fixed": lambda hw, k: replace(hw, a2a_fixed_s=hw.a2a_fixed_s * k),
    "host overheads": lambda hw, k: replace(hw, overheads=_scale_overheads(hw.overheads, k)),
}
FACTORS = (0.5, 2.0)


@dataclass(frozen=True)
class Sensitivity:
    """The count with one constant scaled by each factor (prediction cases only)."""

    constant: str
    counts: tuple[tuple[float, Count], ...]


def sensitivity(
    cases: list[dict] | None = None,
    constants: tuple[str, ...] = tuple(CONSTANTS),
    factors: tuple[float, ...] = FACTORS,
) -> tuple[Count, list[Sensitivity]]:
    """(the count as shipped, the count per constant and factor). Calibration and consistency
    cases are left out: they are not counted either way."""
    cases = [c for c in (cases or load_cases()) if c.get("role", "prediction") == "prediction"]
    base = count(reproduce(cases))
    out = []
    for name in constants:
        scale = CONSTANTS[name]
        per = tuple(
            (k, count(reproduce(cases, lambda hw, k=k, scale=scale: scale(hw, k)))) for k in factors
        )
        out.append(Sensitivity(name, per))
    return base, out


def sensitivity_table(base: Count, results: list[Sensitivity]) -> str:
    factors = [k for k, _ in results[0].counts] if results else list(FACTORS)
    head = (
        f"{'hardware constant (every profile)':<36}"
        + "".join(f"{f'x{k:g}':>14}" for k in factors)
        + "  cases missed"
    )
    lines = [
        f"sensitivity: cases within ±{TOLERANCE:.0%} with one constant scaled "
        f"(as shipped: {base.cases_within}/{base.cases} cases, {base.rows_within}/{base.rows} "
        "rows)",
        head,
    ]
    for s in results:
        cells = "".join(
            f"{f'{c.cases_within}/{c.cases} ({c.rows_within}/{c.rows})':>14}" for _, c in s.counts
        )
        missed = "; ".join(
            f"x{k:g}: " + ", ".join(m for m in c.missed) for k, c in s.counts if c.missed
        )
        lines.append(f"{s.constant:<36}{cells}  {missed}")
    return "\n".join(lines)
