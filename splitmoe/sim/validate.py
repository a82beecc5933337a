"""Simulator predictions for measured runs, and the ±15 % check (``TOLERANCE``).

A measured run is a row of the scaling study's CSV (``scripts/scaling_study.py``): a closed batch
of ``num_requests`` prompts of ``prompt_len`` tokens, each generating ``max_tokens``, on one
instance of ``attention_ranks + expert_ranks`` ranks. `predict_row` adds the simulator's
``pred_*`` figures and relative errors; `check` gives each row its `Verdict`.

The check is on the decode step time (the ranks' median step period, the simulator's TPOT) and on
end-to-end output tokens/s (which adds the prefill and the first token). A point's measured figure
is the median of its repeats; where the row carries their range (``step_min_ms`` /
``step_max_ms``, ``output_tok_s_min`` / ``_max``) the check also asks whether the host held the
point still. A steady point (its repeats within ``TOLERANCE`` of their median) is a *hit* when
both predictions are within ``TOLERANCE`` of the medians, a *miss* otherwise; a noisy point is a
*miss* only where a prediction beyond that tolerance is slower than every repeat (no host noise
explains that), *inconclusive* otherwise: inside the range the repeats measured, or faster than
all of it (a host that slowed every repeat). The study passes when enough of the decidable points
(hits and misses) hit, and says nothing when fewer than `MIN_DECIDABLE_SHARE` of the points are
decidable (`Outcome`). (Client-side TBT is not the step time here: with several rank processes the
driver receives tokens in bursts, so its median gap is about two steps.)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from fractions import Fraction

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

# Below this share of decidable points (hits and misses) among those checked, a check says the
# host was too noisy to judge the model rather than passing or failing it: a verdict on a
# minority of the points would rest on which points the host happened to leave alone.
MIN_DECIDABLE_SHARE = Fraction(1, 2)


class Verdict(str, Enum):
    """What one validation point says about the model."""

    HIT = "hit"  # steady repeats, predictions within the tolerance of their median
    MISS = "miss"  # steady and off, or a prediction slower than every repeat
    INCONCLUSIVE = "inconclusive"  # repeats spread beyond the tolerance, and could hold the model


class Outcome(Enum):
    """What a check says, and the study's exit status for it."""

    PASSED = 0
    FAILED = 1
    INCONCLUSIVE = 2  # too few decidable points: the host, not the model, was measured

    @property
    def exit_status(self) -> int:
        return self.value

    @property
    def word(self) -> str:
        return "passed" if self is Outcome.PASSED else self.name


@dataclass(frozen=True)
class Tally:
    """Counts of a check's validation points by `Verdict`."""

    hits: int
    misses: int
    inconclusive: int

    @classmethod
    def of(cls, verdicts: list[Verdict]) -> Tally:
        def count(kind: Verdict) -> int:
            return sum(v is kind for v in verdicts)

        return cls(count(Verdict.HIT), count(Verdict.MISS), count(Verdict.INCONCLUSIVE))

    @property
    def total(self) -> int:
        return self.hits + self.misses + self.inconclusive

    @property
    def decidable(self) -> int:
        return self.hits + self.misses

    def outcome(self, pass_share: Fraction = Fraction(1)) -> Outcome:
        """PASSED when at least ``pass_share`` of the decidable points hit; INCONCLUSIVE when
        fewer than `MIN_DECIDABLE_SHARE` of the points are decidable; FAILED otherwise, and
        when there is no point at all (nothing was tested)."""
        if self.total == 0:
            return Outcome.FAILED
        if self.decidable < MIN_DECIDABLE_SHARE * self.total:
            return Outcome.INCONCLUSIVE
        return Outcome.PASSED if self.hits >= pass_share * self.decidable else Outcome.FAILED

    def counts(self) -> str:
        return f"hits {self.hits}, misses {self.misses}, inconclusive {self.inconclusive}"


def measured_step_ms(row: dict) -> float:
    """The decode step time a calibration run gives the fit: the fastest of its repeats' step
    periods (``step_min_ms``; each repeat's is the ranks' own median step period). The fastest:
    another process on the host slows a run, nothing speeds one up, and the simulator models the
    host undisturbed. (The check compares with the median, `median_step_ms`: on a steady point
    the fastest repeat is within the tolerance of it.) The median over repeats
    (``step_p50_ms``), or TBT p50, in CSVs without it."""
    return float(row.get("step_min_ms") or row.get("step_p50_ms") or row["tbt_p50_ms"])


def median_step_ms(row: dict) -> float:
    """The decode step time the check compares with: the median over the row's repeats (TBT
    p50 in CSVs without it)."""
    return float(row.get("step_p50_ms") or row["tbt_p50_ms"])


def predictable(row: dict) -> bool:
    """Closed-batch runs of one instance: what `Simulator.run` models."""
    return (
        row.get("status") == "ok"
        and float(row["rate"]) == float("inf")
        and int(row["replicas"]) == 1
    )


def predict_row(sim: Simulator, row: dict) -> dict:
    """``pred_output_tok_s``, ``pred_tbt_ms``, ``pred_ttft_ms`` and errors against the medians
    of the repeats (measured / predicted - 1 is *not* used: errors are (predicted - measured) /
    measured)."""
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
    out["err_tbt"] = r.tbt * 1e3 / median_step_ms(row) - 1
    return out


def _range(row: dict, lo: str, hi: str) -> tuple[float, float] | None:
    if row.get(lo) in (None, "") or row.get(hi) in (None, ""):
        return None
    return float(row[lo]), float(row[hi])


def noisy(row: dict) -> bool:
    """The row's own repeats spread beyond ``TOLERANCE`` of their median (step time or
    throughput): the machine moved this point by more than the check allows."""
    ranges = (
        ("step_min_ms", "step_max_ms", median_step_ms(row)),
        ("output_tok_s_min", "output_tok_s_max", float(row["output_tok_s"])),
    )
    for lo, hi, med in ranges:
        r = _range(row, lo, hi)
        if r and (r[1] > med * (1 + TOLERANCE) or r[0] < med * (1 - TOLERANCE)):
            return True
    return False


def within(row: dict) -> bool:
    """Both predictions within ``TOLERANCE`` of the medians of the repeats."""
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


def predicted_faster(row: dict) -> bool:
    """A miss whose predictions (wherever they miss) are faster than every repeat: a step time
    below the fastest repeat's, tokens/s above. On a noisy point that is what a host that slowed
    every repeat shows of a model of the undisturbed host (nothing speeds a run up)."""
    checks = (
        (row["err_tbt"], "step_min_ms", lambda fastest: row["pred_tbt_ms"] < fastest),
        (row["err_output_tok_s"], "output_tok_s_max",
         lambda fastest: row["pred_output_tok_s"] > fastest),
    )  # fmt: skip
    for err, key, faster in checks:
        if abs(err) <= TOLERANCE:
            continue
        if row.get(key) in (None, "") or not faster(float(row[key])):
            return False
    return True


def _not_ruled_out(row: dict) -> bool:
    """No prediction outside the tolerance is slower than the slowest repeat (a step time above
    ``step_max_ms``, tokens/s below ``output_tok_s_min``), which no host noise would explain."""
    checks = (
        (row["err_tbt"], "step_max_ms", lambda slowest: row["pred_tbt_ms"] > slowest),
        (row["err_output_tok_s"], "output_tok_s_min",
         lambda slowest: row["pred_output_tok_s"] < slowest),
    )  # fmt: skip
    for err, key, slower in checks:
        if abs(err) <= TOLERANCE:
            continue
        if row.get(key) in (None, "") or slower(float(row[key])):
            return False
    return True


def verdict(row: dict) -> Verdict:
    """A predicted row's `Verdict`. A steady point (`noisy` false, or no range recorded) hits
    when `within` and misses otherwise. A noisy point misses only where a prediction is outside
    the tolerance and slower than every repeat; otherwise (the prediction inside the range the
    repeats measured, `miss_inside_range`, or faster than all of it, `predicted_faster`: the
    host may have slowed every repeat) it is inconclusive."""
    if not noisy(row):
        return Verdict.HIT if within(row) else Verdict.MISS
    return Verdict.INCONCLUSIVE if _not_ruled_out(row) else Verdict.MISS


def oversubscribed(row: dict, cores: int | None) -> bool:
    """More rank processes than ``cores`` (None: not known, never): such a point measures the OS
    scheduler's time-slicing as much as the runtime."""
    ranks = int(row["attention_ranks"]) + int(row["expert_ranks"])
    return cores is not None and ranks * int(row.get("replicas") or 1) > cores


@dataclass(frozen=True)
class Check:
    rows: list[dict]  # every predictable row with its predictions, flagged and with its verdict

    @property
    def validation(self) -> list[dict]:
        """The rows that test the model: neither calibration nor oversubscribed."""
        return [r for r in self.rows if not r["calibration"] and not r.get("oversubscribed")]

    @property
    def oversubscribed(self) -> list[dict]:
        return [r for r in self.rows if not r["calibration"] and r.get("oversubscribed")]

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

    def tally(self) -> Tally:
        return Tally.of([verdict(r) for r in self.validation])

    def outcome(self) -> Outcome:
        """Every decidable validation point must hit (`Tally.outcome`)."""
        return self.tally().outcome()

    def noise(self) -> str:
        """How far the machine moved the points: those whose own repeats spread beyond the
        tolerance, where their predictions fell against the repeats, and the load average."""
        rows = self.validation
        if not rows or _range(rows[0], "step_min_ms", "step_max_ms") is None:
            return ""
        loads = sorted(float(r["load_avg"]) for r in rows if r.get("load_avg") not in (None, ""))
        off = [r for r in rows if noisy(r) and not within(r)]
        text = (
            f"noise: the repeats of {sum(noisy(r) for r in rows)} of {len(rows)} validation "
            f"points spread beyond ±{TOLERANCE:.0%} of their median; of the {len(off)} of those "
            f"predicted beyond it, {sum(miss_inside_range(r) for r in off)} inside the range "
            f"their repeats measured and {sum(predicted_faster(r) for r in off)} faster than "
            "every repeat (the host slows runs, nothing speeds one up)"
        )
        if loads:
            text += f"; load average {loads[len(loads) // 2]:.1f} (max {loads[-1]:.1f})"
        return text

    def verdict(self) -> str:
        """One line saying what the check found: hits among the decidable points, the three
        counts, and why the check is inconclusive when it is; a check without validation runs
        fails (nothing was tested)."""
        skipped = len(self.oversubscribed)
        aside = f"; {skipped} oversubscribed points measured, not counted" if skipped else ""
        if self.total == 0:
            return (
                "validation FAILED: no validation runs to check (only calibration runs"
                + (" and oversubscribed layouts" if skipped else "")
                + ")"
            )
        t = self.tally()
        outcome = t.outcome()
        line = (
            f"validation {outcome.word}: {t.hits} of {t.decidable} decidable validation points "
            f"within ±{TOLERANCE:.0%} on both decode-step time and output tokens/s "
            f"({t.total} points: {t.counts()}){aside}"
        )
        if outcome is Outcome.INCONCLUSIVE:
            line += (
                f"; fewer than {float(MIN_DECIDABLE_SHARE):.0%} decidable: the host is too noisy"
            )
        return line

    def table(self) -> str:
        head = (
            f"{'config':<26}{'batch':>6}{'meas tok/s':>12}{'range':>15}{'pred tok/s':>12}"
            f"{'err':>7}{'meas step ms':>14}{'range':>13}{'pred step ms':>14}{'err':>7}  verdict"
        )
        lines = [head]
        for r in self.rows:
            cfg = (
                f"{r['attention_ranks']}A+{r['expert_ranks']}E {r['transport']} "
                f"m={r['micro_batches']} {r['balancer']}"
            )
            lines.append(
                f"{cfg:<26}{int(r['num_requests']):>6}{float(r['output_tok_s']):>12.1f}"
                f"{_range_text(r, 'output_tok_s_min', 'output_tok_s_max', 1):>15}"
                f"{r['pred_output_tok_s']:>12.1f}{r['err_output_tok_s']:>+7.0%}"
                f"{median_step_ms(r):>14.2f}{_range_text(r, 'step_min_ms', 'step_max_ms', 2):>13}"
                f"{r['pred_tbt_ms']:>14.2f}{r['err_tbt']:>+7.0%}  {r['verdict']}"
            )
        if self.noise():
            lines.append(self.noise())
        lines.append(
            f"{self.within} of {self.total} validation points within ±{TOLERANCE:.0%} of their "
            f"medians on both decode-step time and output tokens/s ({self.within_step} on step "
            f"time, {self.within_tok_s} on tokens/s); {self.tally().counts()}"
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


@dataclass(frozen=True)
class HeldOut:
    """The held-out check's result: the points' `Tally`, what it says, and its line."""

    tally: Tally
    outcome: Outcome
    line: str


def held_out(check: Check, runs: tuple = HELD_OUT_RUNS) -> HeldOut:
    """The `Verdict` of each of ``runs`` (`HELD_OUT_RUNS`; a point not measured counts as a
    miss), passed when at least `HELD_OUT_PASS` of every 16 decidable points hit (15 of 16:
    the bar of issue 41, as a share), and the line that says so: ``held-out: N/16 within
    ±15% (...)``. Oversubscribed points count here: the set is fixed, 2A+1E included."""
    rows = {
        run_key(r): r
        for r in check.rows
        if not r["calibration"]
        and r["transport"] in ("none", "flat")
        and r.get("balancer", "static") == "static"
    }
    missing = sum(k not in rows for k in runs)
    verdicts = [verdict(rows[k]) for k in runs if k in rows] + [Verdict.MISS] * missing
    tally = Tally.of(verdicts)
    outcome = tally.outcome(Fraction(HELD_OUT_PASS, len(HELD_OUT_RUNS)))
    line = f"held-out: {tally.hits}/{len(runs)} within ±{TOLERANCE:.0%} ({outcome.word}: "
    line += (
        f"fewer than {float(MIN_DECIDABLE_SHARE):.0%} decidable, the host is too noisy"
        if outcome is Outcome.INCONCLUSIVE
        else f"the bar is {HELD_OUT_PASS}/{len(HELD_OUT_RUNS)} of the decidable points"
    )
    line += f"); {tally.counts()}; batches {', '.join(map(str, sorted({k[2] for k in runs})))}"
    if missing:
        line += f"; {missing} not measured (counted as misses)"
    calib = [r for r in check.rows if r["calibration"]]
    if calib:  # (a fit that cannot reproduce its own runs says the machine moved under it)
        line += f"; calibration runs reproduced: {sum(within(r) for r in calib)}/{len(calib)}"
    return HeldOut(tally, outcome, line)


def _range_text(row: dict, lo: str, hi: str, digits: int) -> str:
    r = _range(row, lo, hi)
    return f"{r[0]:.{digits}f}-{r[1]:.{digits}f}" if r else ""


def check(
    model: ModelShape,
    hw: HardwareProfile,
    rows: list[dict],
    calibration: set | None = None,
    cores: int | None = None,
) -> Check:
    """Predicts every predictable row; the rows whose (attention ranks, expert ranks, requests,
    micro-batches) are in ``calibration`` (static, flat) fitted the profile, those with more
    rank processes than ``cores`` (`oversubscribed`; None: none is) are predicted and shown but
    left out, and the others validate it, each with its `Verdict`."""
    sim = Simulator(model, hw)
    out = []
    for row in rows:
        if not predictable(row):
            continue
        r = {**row, **predict_row(sim, row)}
        key = run_key(row)
        default = row["transport"] in ("none", "flat") and row.get("balancer", "static") == "static"
        r["calibration"] = bool(calibration) and default and key in calibration
        r["oversubscribed"] = oversubscribed(row, cores)
        if r["calibration"]:
            r["verdict"] = "calibration"
        elif r["oversubscribed"]:
            r["verdict"] = "oversubscribed"
        else:
            r["verdict"] = verdict(r).value
        out.append(r)
    return Check(rows=out)
