"""The scaling study's sweep planning, CSV and plots: one real run, the rest stubbed."""

from __future__ import annotations

import csv
import importlib.util
import math
import sys
from pathlib import Path

import pytest
from small_default import write_small_model

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "scaling_study.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("scaling_study", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["scaling_study"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_axes_the_runtime_lacks_are_skipped_with_a_note(study):
    args = study.parse_args(
        ["--attention-ranks", "1,2", "--expert-ranks", "0,1", "--micro-batches", "1,2",
         "--transport", "flat,warp_drive", "--balancer", "static,global", "--max-processes", "3"]
    )  # fmt: skip
    notes: list[str] = []
    topos = study.plan_topologies(args, notes)
    params, _ = study.supported_options()
    text = "\n".join(notes)
    assert "warp_drive" in text
    if "micro_batches" not in params:
        assert "micro_batches=[2]" in text
        assert {t.micro_batches for t in topos} == {1}
    # colocated runs once (no transport, no balancer); at most 3 processes
    assert sum(1 for t in topos if t.expert_ranks == 0) == 2 * len({t.micro_batches for t in topos})
    assert all(t.ranks <= 3 for t in topos)


def _row(a, e, n, tok_s, tbt):
    return dict(
        status="ok", attention_ranks=a, expert_ranks=e, ranks=a + e, replicas=1, transport="flat",
        micro_batches=1, balancer="static", redundant_experts=0, num_requests=n, rate=math.inf,
        prompt_len=16, max_tokens=32, max_num_batched_tokens=2048, repeats=1, duration_s=1.0,
        output_tok_s=tok_s, output_tok_s_per_rank=tok_s / (a + e), ttft_p50_ms=5.0,
        ttft_p90_ms=6.0, ttft_p99_ms=7.0, tbt_p50_ms=tbt, tbt_p90_ms=tbt, tbt_p99_ms=tbt,
        tpot_mean_ms=tbt, comm_share=0.5 if e else 0.0, imbalance=1.0, seqs_per_step_mean=n,
    )  # fmt: skip


def test_csv_and_plots_from_stubbed_rows(study, tmp_path):
    rows = [_row(a, e, n, 100.0 * n / (1 + e), 2.0 * (1 + e)) for a in (1, 2) for e in (0, 1)
            for n in (1, 16)]  # fmt: skip
    study.write_csv(rows, tmp_path / "s.csv")
    got = list(csv.DictReader((tmp_path / "s.csv").open()))
    assert len(got) == 8 and got[0]["rate"] == "inf" and got[0]["tbt_p50_ms"] == "2"
    notes: list[str] = []
    paths = study.write_plots(rows, tmp_path / "plots", notes)
    if any("matplotlib" in n for n in notes):
        assert paths == []
    else:
        names = {p.name for p in paths}
        assert {"scaling_attention_ranks.png", "scaling_expert_ranks.png"} <= names
        assert all(p.stat().st_size > 1000 for p in paths)


def test_plots_skipped_without_matplotlib(study, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    notes: list[str] = []
    assert study.write_plots([_row(1, 0, 1, 10.0, 1.0)], tmp_path, notes) == []
    assert "plots skipped" in notes[0]


def test_one_real_run_end_to_end(study, tmp_path):
    model = write_small_model(tmp_path / "model")
    out = tmp_path / "out"
    rc = study.main(
        ["--model", str(model), "--out", str(out), "--attention-ranks", "1", "--expert-ranks",
         "0", "--batch", "2", "--micro-batches", "1", "--balancer", "static", "--transport",
         "flat", "--max-tokens", "4", "--prompt-len", "4", "--repeats", "1", "--passes", "1",
         "--no-validate"]
    )  # fmt: skip
    assert rc == 0
    rows = list(csv.DictReader((out / "scaling.csv").open()))
    assert len(rows) == 1 and rows[0]["status"] == "ok"
    assert float(rows[0]["output_tok_s"]) > 0 and float(rows[0]["tbt_p50_ms"]) > 0
    assert float(rows[0]["host_wake_us_min"]) > 0  # (probed beside the live rank processes)


def test_repeats_ranges_and_pass_order(study):
    runs = [dict(step_p50_ms=s, output_tok_s=t, load_avg=1.0, host_gb_s=h, host_wake_us=w)
            for s, t, h, w in ((1.0, 90.0, 30.0, 70.0), (1.4, 60.0, 24.0, 90.0),
                               (1.1, 80.0, 33.0, 66.0))]  # fmt: skip
    m = study.median_dict(runs)
    assert (m["host_wake_us"], m["host_wake_us_min"], m["host_wake_us_max"]) == (70.0, 66.0, 90.0)
    assert (m["step_p50_ms"], m["step_min_ms"], m["step_max_ms"]) == (1.1, 1.0, 1.4)
    assert (m["output_tok_s_min"], m["output_tok_s_max"]) == (60.0, 90.0)
    assert (m["host_gb_s"], m["host_gb_s_min"], m["host_gb_s_max"]) == (30.0, 24.0, 33.0)
    topos = study.plan_topologies(study.parse_args(["--quick"]), [])
    orders = [study.pass_order(topos, i, 0) for i in range(3)]
    assert orders[0] == topos and orders[1] == topos[::-1]
    assert sorted(map(str, orders[2])) == sorted(map(str, topos))  # every topology, once


def test_the_host_line_says_whether_the_machine_held_still(study):
    """The probes' ranges over a study against the check's tolerance about their medians; a
    probe an older CSV lacks is left out, and rows without any print nothing."""
    probes = ((32.0, 30.0, 34.0), (33.0, 31.0, 35.0), (31.0, 29.0, 33.0))
    rows = [dict(host_gb_s=m, host_gb_s_min=lo, host_gb_s_max=hi) for m, lo, hi in probes]
    still = study.host_line(rows, 0.15)
    assert still.startswith("host: before the runs, copy bandwidth 29.0-35.0 GB/s (median 32.0")
    assert still.endswith("held within ±15%") and "wake-up" not in still
    for r, us in zip(rows, (70.0, 72.0, 68.0)):
        r.update(host_wake_us=us, host_wake_us_min=us - 4, host_wake_us_max=us + 6)
    still = study.host_line(rows, 0.15)
    assert "wake-up round trip 64-78 us (median 70;" in still and still.endswith("held within ±15%")
    rows[2]["host_wake_us_max"] = 210.0  # (a neighbour on the host: the bandwidth held)
    assert study.host_line(rows, 0.15).endswith("moved beyond ±15%")
    rows[2]["host_wake_us_max"] = 74.0
    rows[1]["host_gb_s_min"] = 24.0  # -25 %
    assert study.host_line(rows, 0.15).endswith("moved beyond ±15%")
    assert study.host_line([dict(step_p50_ms=1.0)], 0.15) == ""
    assert study.host_probe() > 0.1  # GB/s, measured here
    assert 0.1 < study.wake_probe(trips=20) < 1e6  # us, measured here


def test_the_frozen_model_is_the_tree_the_study_imports(study, monkeypatch):
    """The commit printed is this tree's; where `splitmoe` is imported from another checkout
    (an editable install of a CI clone), the line says the run is not of a frozen model."""
    import splitmoe.sim

    line = study.frozen_model()
    assert line.startswith("model: splitmoe/sim at ") or "no git history" in line
    monkeypatch.setattr(splitmoe.sim, "__file__", "/elsewhere/splitmoe/sim/__init__.py")
    assert study.frozen_model() == (
        "model: splitmoe/sim imported from /elsewhere/splitmoe/sim, not this tree "
        "(not a frozen model)"
    )


def test_rows_run_the_micro_batches_they_name(study):
    # left to the runtime, an AF step of 8+ tokens per attention rank splits in two: an "m=1"
    # row at batch 16 measured two micro-batches until the study passed it explicitly
    for m in (1, 2):
        topo = study.Topology(1, 2, "flat", m, "static", 4, 1)
        assert topo.llm_kwargs()["micro_batches"] == m


def test_noise_accounting_of_the_check():
    from splitmoe.sim.validate import miss_inside_range, noisy

    row = dict(step_p50_ms=2.0, step_min_ms=1.9, step_max_ms=2.1, output_tok_s=100.0,
               output_tok_s_min=95.0, output_tok_s_max=105.0, err_tbt=0.3, pred_tbt_ms=2.6,
               err_output_tok_s=-0.25, pred_output_tok_s=75.0)  # fmt: skip
    assert not noisy(row) and not miss_inside_range(row)  # quiet point, model miss
    wide = {**row, "step_max_ms": 2.8, "output_tok_s_min": 70.0}
    assert noisy(wide) and miss_inside_range(wide)  # the repeats reach the prediction


def test_check_failure_is_the_exit_status(study, tmp_path, capsys):
    """Saved rows whose measurements are the shipped CPU profile's own predictions pass the
    check; the same rows against a deliberately wrong profile (GEMMs 20x slower, overheads 5x)
    fail it, and the study says so and exits 1. No run: ``--from-csv`` with ``--profile``."""
    from dataclasses import replace

    from splitmoe.sim.hardware import load_profile
    from splitmoe.sim.model import ModelShape
    from splitmoe.sim.simulator import Simulator
    from splitmoe.sim.validate import Check, predict_row

    model = write_small_model(tmp_path / "model")
    good = load_profile("cpu")
    sim = Simulator(ModelShape.from_config(model), good)
    rows = []
    for a, e, n in ((1, 0, 1), (1, 1, 16), (2, 1, 16)):
        r = _row(a, e, n, 100.0, 2.0)
        pred = predict_row(sim, r)
        r["output_tok_s"], r["tbt_p50_ms"] = pred["pred_output_tok_s"], pred["pred_tbt_ms"]
        rows.append(r)
    study.write_csv(rows, tmp_path / "saved.csv")
    good.to_file(tmp_path / "good.json")
    slow = replace(good.overheads, step_s=good.overheads.step_s * 5 + 1e-3,
                   attn_layer_s=good.overheads.attn_layer_s * 5 + 1e-4)  # fmt: skip
    replace(good, peak_flops=good.peak_flops / 20, overheads=slow).to_file(tmp_path / "bad.json")

    def run(profile: str) -> int:
        return study.main(["--from-csv", str(tmp_path / "saved.csv"), "--profile",
                           str(tmp_path / profile), "--model", str(model), "--out",
                           str(tmp_path / profile.split(".")[0])])  # fmt: skip

    assert run("good.json") == 0
    assert "validation passed: 3 of 3" in capsys.readouterr().out
    assert run("bad.json") == 1
    assert "validation FAILED: 0 of 3" in capsys.readouterr().out
    assert study.exit_code(None) == 0  # no check asked for: nothing failed
    assert study.exit_code(Check(rows=[])) == 1  # a check with nothing to validate fails


def test_held_out_plan_measures_calibration_and_held_out_points(study):
    from splitmoe.sim.calibrate import CALIBRATION_RUNS
    from splitmoe.sim.validate import HELD_OUT_RUNS

    assert len(HELD_OUT_RUNS) == 16 and not set(HELD_OUT_RUNS) & set(CALIBRATION_RUNS)
    topos, batches = study.held_out_plan()
    planned = {(t.attention_ranks, t.expert_ranks, b, t.micro_batches) for t in topos
               for b in batches[t]}  # fmt: skip
    assert planned == set(CALIBRATION_RUNS) | set(HELD_OUT_RUNS)
    for t in topos:  # every row runs the micro-batches it names, flat and static
        assert t.llm_kwargs()["micro_batches"] == t.micro_batches
        assert (t.transport, t.balancer, t.replicas) == ("flat", "static", 1)
    args = study.parse_args(["--held-out"])
    assert (args.repeats, args.passes, args.validate, args.rate) == (1, 5, True, [])
    assert (args.prompt_len, args.max_tokens) == (16, 32)  # the calibration runs' workload
    with pytest.raises(SystemExit):
        study.parse_args(["--held-out", "--quick"])
    # a new set of 16 for a model that has seen these: two other batches, none a calibration's
    args = study.parse_args(["--held-out", "--held-out-batches", "12,24"])
    fresh = study.held_out_set(args)
    assert len(fresh) == 16 and {k[2] for k in fresh} == {12, 24}
    topos, batches = study.held_out_plan(fresh)
    planned = {(t.attention_ranks, t.expert_ranks, b, t.micro_batches) for t in topos
               for b in batches[t]}  # fmt: skip
    assert planned == set(CALIBRATION_RUNS) | set(fresh)
    for bad in (["--held-out-batches", "12,24"], ["--held-out", "--held-out-batches", "16,24"],
                ["--held-out", "--held-out-batches", "12"]):  # fmt: skip
        with pytest.raises(SystemExit):
            study.parse_args(bad)


def test_held_out_check_counts_the_sixteen_points(study, tmp_path, capsys):
    """Saved held-out rows measured as the shipped profile predicts them: 16/16, exit 0; one
    point 30 % slower: 15/16, still the bar; two: 14/16, exit 1; a deliberately wrong
    profile: 0/16, exit 1. No run (``--from-csv`` with ``--profile``)."""
    from dataclasses import replace

    from splitmoe.sim.hardware import load_profile
    from splitmoe.sim.model import ModelShape
    from splitmoe.sim.simulator import Simulator
    from splitmoe.sim.validate import HELD_OUT_RUNS, predict_row

    model = write_small_model(tmp_path / "model")
    good = load_profile("cpu")
    good.to_file(tmp_path / "good.json")
    slow = replace(good.overheads, step_s=good.overheads.step_s * 5 + 1e-3)
    replace(good, peak_flops=good.peak_flops / 20, overheads=slow).to_file(tmp_path / "bad.json")
    sim = Simulator(ModelShape.from_config(model), good)
    rows = []
    for a, e, n, m in HELD_OUT_RUNS:
        r = {**_row(a, e, n, 100.0, 2.0), "micro_batches": m}
        pred = predict_row(sim, r)
        r["output_tok_s"], r["tbt_p50_ms"] = pred["pred_output_tok_s"], pred["pred_tbt_ms"]
        rows.append(r)

    def run(slow: int, profile: str = "good.json") -> int:
        saved = [dict(r) for r in rows]
        for r in saved[:slow]:  # measured 30 % slower than predicted
            r["tbt_p50_ms"] *= 1.3
            r["output_tok_s"] /= 1.3
        study.write_csv(saved, tmp_path / "saved.csv")
        return study.main(["--held-out", "--from-csv", str(tmp_path / "saved.csv"), "--profile",
                           str(tmp_path / profile), "--model", str(model), "--out",
                           str(tmp_path / "out")])  # fmt: skip

    assert run(0) == 0 and "held-out: 16/16 within ±15% (passed" in capsys.readouterr().out
    assert run(1) == 0 and "held-out: 15/16 within ±15% (passed" in capsys.readouterr().out
    assert run(2) == 1 and "held-out: 14/16 within ±15% (FAILED" in capsys.readouterr().out
    assert run(0, "bad.json") == 1 and "held-out: 0/16" in capsys.readouterr().out
    rows = rows[:10]  # points not measured count as misses
    assert run(0) == 1 and "6 not measured" in capsys.readouterr().out
