"""The check's three verdicts (hit, miss, inconclusive) and the study's exit status, fed
synthetic repeats around the shipped CPU profile's own predictions: no run."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
from small_default import write_small_model

from splitmoe.sim.hardware import load_profile
from splitmoe.sim.model import ModelShape
from splitmoe.sim.simulator import Simulator
from splitmoe.sim.validate import predict_row

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "scaling_study.py"

# repeats as multiples of the predicted step time (tokens/s moves inversely): five, as --quick
STEADY_ON = (0.97, 0.99, 1.0, 1.02, 1.05)  # within ±15 % of their median, on the prediction
STEADY_OFF = (1.28, 1.3, 1.3, 1.33, 1.36)  # steady, 30 % slower than predicted
NOISY_ON = (0.95, 1.2, 1.25, 1.3, 1.6)  # median 25 % off, but the repeats reach the prediction
SLOWED = (1.3, 1.5, 1.6, 1.7, 2.2)  # spread beyond ±15 %, all slower than predicted: a loaded host
NOISY_OFF = (0.45, 0.55, 0.6, 0.65, 0.8)  # spread, all faster than predicted: no load explains it


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("scaling_study", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["scaling_study"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_small_model(tmp_path_factory.mktemp("model"))


def _point(study, model: Path, a: int, e: int, n: int, m: int, repeats: tuple) -> dict:
    """A row measured as ``repeats`` x the shipped profile's predicted step time (and its
    tokens/s divided by them), through the study's own reduction of repeats (`median_dict`)."""
    row = dict(
        status="ok", attention_ranks=a, expert_ranks=e, ranks=a + e, replicas=1, transport="flat",
        micro_batches=m, balancer="static", redundant_experts=0, num_requests=n, rate=math.inf,
        prompt_len=16, max_tokens=32, max_num_batched_tokens=2048, repeats=len(repeats),
        duration_s=1.0, ttft_p50_ms=5.0, ttft_p90_ms=6.0, ttft_p99_ms=7.0, comm_share=0.0,
        imbalance=1.0, seqs_per_step_mean=n, cores=2, tbt_p50_ms=1.0, output_tok_s=1.0,
    )  # fmt: skip
    pred = predict_row(Simulator(ModelShape.from_config(model), load_profile("cpu")), row)
    runs = [
        dict(step_p50_ms=pred["pred_tbt_ms"] * x, output_tok_s=pred["pred_output_tok_s"] / x)
        for x in repeats
    ]
    got = study.median_dict(runs)
    return {**row, **got, "tbt_p50_ms": got["step_p50_ms"]}


def _check(model: Path, rows: list[dict], cores: int | None = 2):
    from splitmoe.sim.validate import check

    return check(ModelShape.from_config(model), load_profile("cpu"), rows, cores=cores)


def test_three_verdicts_from_synthetic_repeats(study, model):
    """Steady and on the prediction: hit; steady and off it: miss; spread beyond ±15 % and
    reaching the prediction: inconclusive; spread and all slower than predicted (a host that
    slowed every repeat): inconclusive; spread and all faster: miss. A 2A+1E point on 2 cores is
    predicted and marked, never judged."""
    from splitmoe.sim.validate import Verdict, verdict

    kinds = (STEADY_ON, STEADY_OFF, NOISY_ON, SLOWED, NOISY_OFF)
    rows = [_point(study, model, 1, 0, 16, 2, r) for r in kinds]
    rows.append(_point(study, model, 2, 1, 16, 1, STEADY_OFF))
    got = _check(model, rows)
    assert [verdict(r) for r in got.rows[:5]] == [
        Verdict.HIT, Verdict.MISS, Verdict.INCONCLUSIVE, Verdict.INCONCLUSIVE, Verdict.MISS
    ]  # fmt: skip
    assert [r["verdict"] for r in got.rows] == [
        "hit", "miss", "inconclusive", "inconclusive", "miss", "oversubscribed"
    ]  # fmt: skip
    assert len(got.validation) == 5 and len(got.oversubscribed) == 1
    # the measured figure is the median of the repeats, not the fastest of them
    assert got.rows[2]["err_tbt"] == pytest.approx(1 / 1.25 - 1)
    t = got.tally()
    assert (t.hits, t.misses, t.inconclusive, t.decidable) == (1, 2, 2, 3)
    assert "of the 3 of those predicted beyond it, 1 inside the range" in got.noise()
    assert "and 1 faster than every repeat" in got.noise()
    # where the cores are not known (an older CSV), every layout is judged
    assert len(_check(model, rows, cores=None).validation) == 6


def test_counts_and_exit_status(study, model):
    """0 when every decidable point hits, 1 when a decidable point misses, 2 when fewer than
    half are decidable (even with a miss among them: a loaded host slowing every repeat is not
    a failed model); oversubscribed points change nothing; a check with nothing to validate
    fails."""
    from splitmoe.sim.validate import Check, Outcome

    def status(*kinds: tuple, cores: int | None = 2) -> int:
        rows = [_point(study, model, a, e, 16, 2, r) for a, e, r in kinds]
        return study.exit_code(_check(model, rows, cores))

    hit, miss = (1, 0, STEADY_ON), (1, 0, STEADY_OFF)
    noisy, slowed, wide = (1, 1, NOISY_ON), (2, 0, SLOWED), (2, 0, NOISY_OFF)
    crowded = (2, 1, STEADY_OFF)  # three rank processes on two cores, far off
    assert status(hit, hit, noisy) == 0
    assert status(hit, hit, noisy, crowded) == 0  # not counted against the model
    assert status(hit, hit, noisy, crowded, cores=None) == 1  # ... unless the cores are unknown
    assert status(hit, miss, noisy) == 1
    assert status(hit, wide, noisy) == 1  # spread, but faster than the model: a miss
    assert status(hit, hit, slowed) == 0
    assert status(hit, noisy, noisy) == 2  # 1 of 3 decidable
    assert status(hit, slowed, slowed, noisy) == 2  # a loaded host: inconclusive, not failed
    assert status(miss, noisy, noisy, noisy) == 2  # 1 of 4: the host, not the model, was judged
    assert status(hit, hit, noisy, noisy) == 0  # half decidable is enough
    assert study.exit_code(Check(rows=[])) == 1
    only_crowded = [_point(study, model, 2, 1, 16, 1, STEADY_OFF)]
    assert study.exit_code(_check(model, only_crowded)) == 1  # nothing the host could run
    assert [o.exit_status for o in Outcome] == [0, 1, 2]


def test_the_summary_line_and_exit_status_of_a_saved_study(study, model, tmp_path, capsys):
    """``--from-csv`` with ``--profile``: the last line gives the decidable hits and all three
    counts, and the oversubscribed points set aside (the CSV records 2 cores)."""
    load_profile("cpu").to_file(tmp_path / "cpu.json")

    def run(*kinds: tuple) -> tuple[int, str]:
        rows = [_point(study, model, a, e, 16, 2, r) for a, e, r in kinds]
        study.write_csv(rows, tmp_path / "saved.csv")
        rc = study.main(["--from-csv", str(tmp_path / "saved.csv"), "--profile",
                         str(tmp_path / "cpu.json"), "--model", str(model), "--out",
                         str(tmp_path / "out")])  # fmt: skip
        return rc, capsys.readouterr().out.strip().splitlines()[-1]

    rc, line = run((1, 0, STEADY_ON), (1, 1, STEADY_ON), (2, 0, NOISY_ON), (1, 2, NOISY_OFF))
    assert rc == 0
    assert line.startswith("validation passed: 2 of 2 decidable validation points within ±15%")
    assert "(3 points: hits 2, misses 0, inconclusive 1)" in line
    assert line.endswith("1 oversubscribed points measured, not counted")
    rc, line = run((1, 0, STEADY_ON), (1, 1, NOISY_ON), (2, 0, NOISY_ON))
    assert rc == 2 and line.startswith("validation INCONCLUSIVE: 1 of 1 decidable")
    assert "hits 1, misses 0, inconclusive 2" in line and "the host is too noisy" in line
    rc, line = run((1, 0, STEADY_ON), (1, 1, STEADY_OFF), (2, 0, NOISY_ON))
    assert rc == 1 and line.startswith("validation FAILED: 1 of 2 decidable")
    verdicts = [r["verdict"] for r in study.read_csv(tmp_path / "out" / "scaling.csv")]
    assert verdicts == ["hit", "miss", "inconclusive"]


def test_held_out_keeps_its_bar_as_a_share_of_the_decidable_points(study, model):
    """The same three verdicts on the 16 held-out points (2A+1E counted on any host): 15 of 16
    hits passes, inconclusive points leave the bar to the decidable ones (all of them, with
    fewer than 16), and fewer than half decidable says nothing (exit 2)."""
    from splitmoe.sim.validate import HELD_OUT_RUNS, Outcome, held_out

    def result(kinds: list[tuple]):
        rows = [_point(study, model, *run, k) for run, k in zip(HELD_OUT_RUNS, kinds)]
        got = held_out(_check(model, rows), HELD_OUT_RUNS)
        assert got.outcome.exit_status == study.exit_code(_check(model, rows), HELD_OUT_RUNS)
        return got

    got = result([STEADY_ON] * 15 + [STEADY_OFF])
    assert got.outcome is Outcome.PASSED and got.line.startswith("held-out: 15/16 within ±15%")
    assert "hits 15, misses 1, inconclusive 0" in got.line
    assert result([STEADY_ON] * 10 + [NOISY_ON] * 6).outcome is Outcome.PASSED
    assert result([STEADY_ON] * 9 + [NOISY_ON] * 6 + [STEADY_OFF]).outcome is Outcome.FAILED
    got = result([STEADY_ON] * 7 + [NOISY_ON] * 9)
    assert got.outcome is Outcome.INCONCLUSIVE and "(INCONCLUSIVE: fewer than 50%" in got.line


def test_the_host_check_says_first_how_many_repeats_a_noisy_host_needs(study):
    """Readings within ±15 % of their median: held; one probe beyond: the verdict will be weak,
    with the repeats a point's median needs and the ``--passes`` that gives them."""
    still = {"host_gb_s": [30.0, 31.0, 29.5, 30.5, 32.0], "host_wake_us": [70.0, 72.0, 69.0]}
    line = study.host_check(still, 0.15, repeats=5, per_pass=1)
    assert line.startswith("host check: 5 readings before the study, copy bandwidth 29.5-32.0")
    assert line.endswith("held within ±15%")
    moving = {**still, "host_gb_s": [20.0, 26.0, 31.0, 36.0, 42.0, 30.0, 24.0]}
    need = study.repeats_needed(moving["host_gb_s"], 0.15)
    assert need > 5
    line = study.host_check(moving, 0.15, repeats=5, per_pass=1)
    assert "moved beyond ±15%, so the verdict will be weak" in line
    assert line.endswith(f"needs ~{need} repeats to be known within ±15% (95 %), this run takes "
                         f"5: --passes {need}")  # fmt: skip
    assert study.repeats_needed([30.0] * 5, 0.15) == 1
    assert study.usable_cores() >= 1
