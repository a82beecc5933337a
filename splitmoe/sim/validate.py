"""Simulator predictions for measured runs, and the ±15 % check (``TOLERANCE``).

A measured run is a row of the scaling study's CSV (``scripts/scaling_study.py``): a closed batch
of ``num_requests`` prompts of ``prompt_len`` tokens, each generating ``max_tokens``, on one
instance of ``attention_ranks + expert_ranks`` ranks. `predict_row` adds the simulator's
``pred_*`` figures and relative errors; `check` says which rows fall within the tolerance.

The check is on the decode step time (the ranks' median step period, the simulator's TPOT) and
on end-to-end output tokens/s (which adds the prefill and the first token), both within
``TOLERANCE``. Where a row carries the range of its repeats (``step_min_ms`` / ``step_max_ms``,
``output_tok_s_min`` / ``_max``) the check also says how much of a miss is the machine's noise:
points whose own repeats spread beyond the tolerance, and misses whose prediction lies inside the
measured range. (Client-side TBT is not the step time here: with several rank processes the driver
receives tokens in bursts, so its median gap is about two steps.)
"""

from __future__ import annotations

from dataclasses import dataclass

from splitmoe.sim.hardware import HardwareProfile
from splitmoe.sim.model import ModelShape
from splitmoe.sim.simulator import Deployment, Simulator

TOLERANCE = 0.15

# The held-out sweep (issue 41; docs/scaling.md §4): configurations never used while developing
# the model, (attention ranks, expert ranks, closed batch, micro-batches) on the realistic
# preset, flat transport, static balancer; predicted with a profile fitted on the calibration
# runs alone. The check passes with `HELD_OUT_PASS` of them within `TOLERANCE`. Once a model
# change has seen them, a new set is the same topologies and counts at two other batches
# (`held_out_runs`).
HELD_OUT_BATCHES = (8, 32)


def held_out_runs(batches: tuple[int, int] = HELD_OUT_BATCHES) -> tuple[tuple[int, ...], ...]:
    """The 16 held-out points at two closed batches: 1A+0E, 1A+1E, 2A+0E, 2A+1E at m = 1, 2."""
    return tuple(
        (a, e, b, m) for a, e in ((1, 0), (1, 1), (2, 0), (2, 1)) for b in batches for m in (1, 2)
    )


HELD_OUT_RUNS = held_out_runs()
HELD_OUT_PASS = 15


def measured_step_ms(row: dict) -> float:
    """The decode step time a row measured: the fastest of its repeats' step periods
    (``step_min_ms``; each repeat's is the ranks' own median step period). The fastest: another
    process on the host slows a run, nothing speeds one up, and the simulator models the host
    undisturbed. The median over repeats (``step_p50_ms``), or TBT p50, in CSVs without it."""
    return float(row.get("step_min_ms") or row.get("step_p50_ms") or row["tbt_p50_ms"])


def measured_tok_s(row: dict) -> float:
    """The output tokens/s a row measured: the fastest repeat's (``output_tok_s_max``), as
    `measured_step_ms`; the median over repeats in CSVs without it."""
    return float(row.get("output_tok_s_max") or row["output_tok_s"])


def _median_step_ms(row: dict) -> float:
    return float(row.get("step_p50_ms") or row["tbt_p50_ms"])


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
    out["err_output_tok_s"] = r.output_tok_s / measured_tok_s(row) - 1
    out["err_tbt"] = r.tbt * 1e3 / measured_step_ms(row) - 1
    return out


def _range(row: dict, lo: str, hi: str) -> tuple[float, float] | None:
    if row.get(lo) in (None, "") or row.get(hi) in (None, ""):
        return None
    return float(row[lo]), float(row[hi])


def noisy(row: dict) -> bool:
    """The row's own repeats spread beyond ``TOLERANCE`` of their median (step time or
    throughput): the machine moved this point by more than the check allows."""
    ranges = (
        ("step_min_ms", "step_max_ms", _median_step_ms(row)),
        ("output_tok_s_min", "output_tok_s_max", float(row["output_tok_s"])),
    )
    for lo, hi, med in ranges:
        r = _range(row, lo, hi)
        if r and (r[1] > med * (1 + TOLERANCE) or r[0] < med * (1 - TOLERANCE)):
            return True
    return False


def within(row: dict) -> bool:
    return abs(row["err_tbt"]) <= TOLERANCE and abs(row["err_output_tok_s"]) <= TOLERANCE


def miss_inside_range(row: dict) -> bool:
    """A miss whose predictions (wherever they miss) lie inside the range its repeats measured."""
    checks = (
        (row["err_tbt"], ("step_min_ms", "step_max_ms"), row["pred_tbt_ms"]),
        (row["err_output_tok_s"], ("output_tok_s_min", "output_tok_s_max"),
         row["pred_output_tok_s"]),
    )  # fmt: skip
    for err, (lo, hi), pred in checks:
        if abs(err) <= TOLERANCE:
            continue
        r = _range(row, lo, hi)
        if r is None or not r[0] <= pred <= r[1]:
            return False
    return True


@dataclass(frozen=True)
class Check:
    rows: list[dict]  # every predictable row with its predictions (calibration ones flagged)

    @property
    def validation(self) -> list[dict]:
        return [r for r in self.rows if not r["calibration"]]

    @property
    def total(self) -> int:
        return len(self.validation)

    @property
    def within_step(self) -> int:
        return sum(abs(r["err_tbt"]) <= TOLERANCE for r in self.validation)

    @property
    def within_tok_s(self) -> int:
        return sum(abs(r["err_output_tok_s"]) <= TOLERANCE for r in self.validation)

    @property
    def within(self) -> int:
        """Validation rows whose decode-step time and output tokens/s are both within."""
        return sum(within(r) for r in self.validation)

    def noise(self) -> str:
        """How much of the misses is the machine: points moved beyond the tolerance by their own
        repeats, misses inside the measured range, and the load average while they ran."""
        rows = self.validation
        if not rows or _range(rows[0], "step_min_ms", "step_max_ms") is None:
            return ""
        misses = [r for r in rows if not within(r)]
        loads = sorted(float(r["load_avg"]) for r in rows if r.get("load_avg") not in (None, ""))
        text = (
            f"noise: the repeats of {sum(noisy(r) for r in rows)} of {len(rows)} validation "
            f"points spread beyond ±{TOLERANCE:.0%} of their median; "
            f"{sum(miss_inside_range(r) for r in misses)} of the {len(misses)} misses are "
            "predicted inside the range their repeats measured"
        )
        if loads:
            text += f"; load average {loads[len(loads) // 2]:.1f} (max {loads[-1]:.1f})"
        return text

    @property
    def passed(self) -> bool:
        return self.total > 0 and self.within == self.total

    def verdict(self) -> str:
        """One line saying whether the check passed; a check without validation runs fails
        (nothing was tested)."""
        if self.total == 0:
            return "validation FAILED: no validation runs to check (only calibration runs)"
        word = "passed" if self.passed else "FAILED"
        return (
            f"validation {word}: {self.within} of {self.total} validation runs within "
            f"±{TOLERANCE:.0%} on both decode-step time and output tokens/s"
        )

    def table(self) -> str:
        head = (
            f"{'config':<26}{'batch':>6}{'meas tok/s':>12}{'pred tok/s':>12}{'err':>8}"
            f"{'meas step ms':>14}{'range':>13}{'pred step ms':>14}{'err':>8}  use"
        )
        lines = [head]
        for r in self.rows:
            cfg = (
                f"{r['attention_ranks']}A+{r['expert_ranks']}E {r['transport']} "
                f"m={r['micro_batches']} {r['balancer']}"
            )
            lines.append(
                f"{cfg:<26}{int(r['num_requests']):>6}{measured_tok_s(r):>12.1f}"
                f"{r['pred_output_tok_s']:>12.1f}{r['err_output_tok_s']:>+8.0%}"
                f"{measured_step_ms(r):>14.2f}{_range_text(r):>13}"
                f"{r['pred_tbt_ms']:>14.2f}{r['err_tbt']:>+8.0%}"
                f"  {'calibration' if r.get('calibration') else 'validation'}"
            )
        if self.noise():
            lines.append(self.noise())
        lines.append(
            f"{self.within} of {self.total} validation runs within ±{TOLERANCE:.0%} on both "
            f"decode-step time and output tokens/s ({self.within_step} on step time, "
            f"{self.within_tok_s} on tokens/s)"
        )
        return "\n".join(lines)


def run_key(row: dict) -> tuple[int, int, int, int]:
    """(attention ranks, expert ranks, requests, micro-batches) of a row."""
    return (
        int(row["attention_ranks"]),
        int(row["expert_ranks"]),
        int(row["num_requests"]),
        int(row["micro_batches"]),
    )


def held_out(check: Check, runs: tuple = HELD_OUT_RUNS) -> tuple[int, bool, str]:
    """How many of ``runs`` (`HELD_OUT_RUNS`) the check has within `TOLERANCE` on both step
    time and tokens/s (a point not measured counts as a miss), whether that is at least
    `HELD_OUT_PASS`, and the line that says so: ``held-out: N/16 within ±15%``."""
    rows = {
        run_key(r): r
        for r in check.validation
        if r["transport"] in ("none", "flat") and r.get("balancer", "static") == "static"
    }
    n = sum(within(rows[k]) for k in runs if k in rows)
    missing = sum(k not in rows for k in runs)
    passed = n >= HELD_OUT_PASS
    line = f"held-out: {n}/{len(runs)} within ±{TOLERANCE:.0%}"
    line += f" ({'passed' if passed else 'FAILED'}: the bar is {HELD_OUT_PASS})"
    line += f"; batches {', '.join(map(str, sorted({k[2] for k in runs})))}"
    if missing:
        line += f"; {missing} not measured (counted as misses)"
    calib = [r for r in check.rows if r["calibration"]]
    if calib:  # (a fit that cannot reproduce its own runs says the machine moved under it)
        line += f"; calibration runs reproduced: {sum(within(r) for r in calib)}/{len(calib)}"
    return n, passed, line


def _range_text(row: dict) -> str:
    r = _range(row, "step_min_ms", "step_max_ms")
    return f"{r[0]:.2f}-{r[1]:.2f}" if r else ""


def check(
    model: ModelShape, hw: HardwareProfile, rows: list[dict], calibration: set | None = None
) -> Check:
    """Predicts every predictable row; the rows whose (attention ranks, expert ranks, requests,
    micro-batches) are in ``calibration`` (static, flat) fitted the profile, the others validate
    it."""
    sim = Simulator(model, hw)
    out = []
    for row in rows:
        if not predictable(row):
            continue
        r = {**row, **predict_row(sim, row)}
        key = run_key(row)
        default = row["transport"] in ("none", "flat") and row.get("balancer", "static") == "static"
        r["calibration"] = bool(calibration) and default and key in calibration
        out.append(r)
    return Check(rows=out)
