"""Simulator predictions for measured runs, and the ±25 % check.

A measured run is a row of the scaling study's CSV (``scripts/scaling_study.py``): a closed batch
of ``num_requests`` prompts of ``prompt_len`` tokens, each generating ``max_tokens``, on one
instance of ``attention_ranks + expert_ranks`` ranks. `predict_row` adds the simulator's
``pred_*`` figures and relative errors; `check` says which rows fall within the tolerance.

The check is on the decode step time (TBT p50, the simulator's TPOT): it is what the simulator
predicts and what the planner's SLO is about. End-to-end output tokens/s is reported beside it;
it also carries the run's start-up and the tail of stalls other work on this machine causes
(TBT p99 is often 3x the median here), which a model of the median step does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitmoe.sim.hardware import HardwareProfile
from splitmoe.sim.model import ModelShape
from splitmoe.sim.simulator import Deployment, Simulator

TOLERANCE = 0.25


def predictable(row: dict) -> bool:
    """Closed-batch runs of one instance: what `Simulator.run` models."""
    return (
        row.get("status") == "ok"
        and float(row["rate"]) == float("inf")
        and int(row["replicas"]) == 1
    )


def predict_row(sim: Simulator, row: dict) -> dict:
    """``pred_output_tok_s``, ``pred_tbt_ms``, ``pred_ttft_ms`` and errors (measured / predicted
    - 1 is *not* used: errors are (predicted - measured) / measured)."""
    dep = Deployment(
        attention_ranks=int(row["attention_ranks"]),
        expert_ranks=int(row["expert_ranks"]),
        micro_batches=int(row["micro_batches"]),
        transport=row["transport"] if row["transport"] in ("two_phase", "auto") else "flat",
        balancer=row["balancer"],
        redundant_experts=int(row.get("redundant_experts") or 0),
    )
    r = sim.run(
        dep,
        int(row["num_requests"]),
        int(row["prompt_len"]),
        int(row["max_tokens"]),
        int(row["max_num_batched_tokens"]),
    )
    out = {
        "pred_output_tok_s": r.output_tok_s,
        "pred_tbt_ms": r.tbt * 1e3,
        "pred_ttft_ms": r.ttft * 1e3,
        "pred_comm_share": r.decode.comm_share,
    }
    out["err_output_tok_s"] = r.output_tok_s / float(row["output_tok_s"]) - 1
    out["err_tbt"] = r.tbt * 1e3 / float(row["tbt_p50_ms"]) - 1
    return out


@dataclass(frozen=True)
class Check:
    rows: list[dict]  # validation rows with predictions
    within: int
    total: int

    @property
    def within_tok_s(self) -> int:
        return sum(
            1 for r in self.rows if not r["calibration"] and abs(r["err_output_tok_s"]) <= TOLERANCE
        )

    @property
    def passed(self) -> bool:
        return self.total > 0 and self.within >= min(4, self.total)

    def table(self) -> str:
        head = (
            f"{'config':<24}{'batch':>6}{'meas tok/s':>12}{'pred tok/s':>12}{'err':>8}"
            f"{'meas TBT ms':>13}{'pred TBT ms':>13}{'err':>8}  use"
        )
        lines = [head]
        for r in self.rows:
            cfg = (
                f"{r['attention_ranks']}A+{r['expert_ranks']}E {r['transport']} "
                f"m={r['micro_batches']}"
            )
            lines.append(
                f"{cfg:<24}{int(r['num_requests']):>6}{float(r['output_tok_s']):>12.1f}"
                f"{r['pred_output_tok_s']:>12.1f}{r['err_output_tok_s']:>+8.0%}"
                f"{float(r['tbt_p50_ms']):>13.2f}{r['pred_tbt_ms']:>13.2f}{r['err_tbt']:>+8.0%}"
                f"  {'calibration' if r.get('calibration') else 'validation'}"
            )
        lines.append(
            f"{self.within} of {self.total} validation runs within ±{TOLERANCE:.0%} on TBT p50 "
            f"(decode step); {self.within_tok_s} of {self.total} on end-to-end output tokens/s"
        )
        return "\n".join(lines)


def check(
    model: ModelShape, hw: HardwareProfile, rows: list[dict], calibration: set | None = None
) -> Check:
    """Predicts every predictable row; counts validation rows (not used for calibration) whose
    TBT p50 is within ±25 % of the measurement."""
    sim = Simulator(model, hw)
    out, within, total = [], 0, 0
    for row in rows:
        if not predictable(row):
            continue
        r = {**row, **predict_row(sim, row)}
        key = (int(row["attention_ranks"]), int(row["expert_ranks"]), int(row["num_requests"]))
        default = int(row["micro_batches"]) == 1 and row["transport"] in ("none", "flat")
        r["calibration"] = bool(calibration) and default and key in calibration
        if not r["calibration"]:
            total += 1
            within += abs(r["err_tbt"]) <= TOLERANCE
        out.append(r)
    return Check(rows=out, within=within, total=total)
