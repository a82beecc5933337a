"""Fitting the CPU profile's step-level constants from the study's calibration runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitmoe.sim.calibrate import (
    CALIBRATION_PROMPT,
    CALIBRATION_RUNS,
    CALIBRATION_TOKENS,
    fit_runs,
)
from splitmoe.sim.hardware import HardwareProfile, Overheads
from splitmoe.sim.model import ModelShape
from splitmoe.sim.simulator import Deployment, Simulator

SHAPE = ModelShape(
    name="tiny", hidden=64, num_layers=4, num_moe_layers=4, vocab=256, num_experts=16, top_k=4,
    moe_intermediate=32, num_heads=4, num_kv_heads=2, head_dim=16,
)  # fmt: skip
COMPONENTS = Overheads(attn_layer_s=120e-6, seq_layer_s=3e-6, prefill_seq_layer_s=20e-6,
                       moe_layer_s=110e-6, expert_s=5e-6)  # fmt: skip


def _cpu(oh: Overheads, **kw) -> HardwareProfile:
    return HardwareProfile(
        name="cpu", peak_flops=1e11, mem_bytes_per_s=4e10, memory_bytes=1e10, gpus_per_node=64,
        weight_bytes=4, cores=2.0, overheads=oh, **kw,
    )  # fmt: skip


def _step(hw: HardwareProfile, a: int, e: int, b: int, m: int) -> float:
    dep = Deployment(a, e, micro_batches=m)
    run = Simulator(SHAPE, hw).run(dep, b, CALIBRATION_PROMPT, CALIBRATION_TOKENS, 2048)
    return run.tbt


def test_fit_recovers_the_step_constants_of_a_known_machine():
    truth = _cpu(
        replace(COMPONENTS, step_s=300e-6, proc_step_s=120e-6, busy_attention_step_s=200e-6,
                proc_seq_step_s=12e-6, collective_s=(0.0, 30e-6), empty_micro_batch_s=90e-6,
                wake_s=70e-6, shared_step_s=250e-6, shared_attention_step_s=400e-6),
        oversubscribed=1.9,
    )  # fmt: skip
    runs = {key: _step(truth, *key) for key in CALIBRATION_RUNS}
    fitted = fit_runs(SHAPE, _cpu(COMPONENTS), runs)
    for key, t in runs.items():  # every calibration run reproduced
        assert _step(fitted, *key) == pytest.approx(t, rel=0.02), key
    # the multi-process constants are told apart: the driver's step, the wait for a second
    # attention rank with work, a collective call, a sequence's trips through the expert ranks;
    # and those of ranks sharing cores: a wake-up (what a second micro-batch adds), the step
    # boundary per rank, the slow-down of per-token work
    oh = fitted.overheads
    assert oh.proc_step_s == pytest.approx(120e-6, rel=0.05)
    assert oh.busy_attention_step_s == pytest.approx(200e-6, rel=0.05)
    assert oh.proc_seq_step_s == pytest.approx(12e-6, rel=0.05)
    assert oh.collective(2) == pytest.approx(30e-6, rel=0.05)
    assert oh.wake_s == pytest.approx(70e-6, rel=0.05)
    assert oh.shared_step_s == pytest.approx(250e-6, rel=0.05)
    assert oh.shared_attention_step_s == pytest.approx(400e-6, rel=0.05)
    assert fitted.oversubscribed == pytest.approx(1.9, rel=0.05)
    # and the configurations it was not fitted on
    for key in ((2, 1, 1, 1), (2, 1, 16, 2), (2, 2, 1, 1), (2, 2, 16, 2), (1, 1, 16, 2)):
        assert _step(fitted, *key) == pytest.approx(_step(truth, *key), rel=0.05), key


def test_the_grids_time_both_ends_of_every_kernel_class():
    """The runtime's kernel choices hold per size class of rows (attention, projections) or of
    pairs (experts), and a count just above a class's top runs the next one's kernel: the grids
    time the first and the last count of each class, so the curves through them step where
    the runtime does."""
    from splitmoe.kernels.cpu_choice import half_octave_bucket, pow2_bucket
    from splitmoe.sim.calibrate import (
        ATTENTION_GRID_SEQS,
        class_ends,
        expert_grid_tokens,
        expert_timed_tokens,
    )

    assert ATTENTION_GRID_SEQS == (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64)
    assert expert_grid_tokens(4) == (
        1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 24, 25, 32, 33, 48, 49, 64
    )  # fmt: skip
    # ... and with the prefill points, each count timed once (64 tokens is in both)
    assert expert_timed_tokens(4)[-6:] == (48, 49, 64, 128, 256, 512)
    for bucket in (pow2_bucket, half_octave_bucket):
        for per in (1, 2, 4, 6, 8):
            ends = class_ends(48, per, bucket)
            for n in range(1, 49):
                same = [e for e in ends if bucket(e * per) == bucket(n * per)]
                assert min(same) <= n <= max(same), (per, n, ends)
                if n > 1 and bucket(n * per) != bucket((n - 1) * per):
                    assert n in ends and n - 1 in ends  # (both sides of a class boundary)
            assert ends[0] == 1 and ends[-1] == 48


def test_a_cost_that_falls_with_its_count_is_pooled():
    """Medians that fall as the count grows are the host's noise: pooled to their mean, the
    rest kept (least squares under the constraint)."""
    from splitmoe.sim.calibrate import _nondecreasing

    assert _nondecreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert _nondecreasing([5.0, 1.0, 1.0, 1.0]) == [2.0, 2.0, 2.0, 2.0]
    assert _nondecreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]


def test_components_are_timed_round_robin():
    """Each round times every point in turn, so a host whose speed drifts slows a round's
    points alike; a point's first call of a round is discarded (it pays for what the point
    before it left in the caches), and its figure is the median of the second calls."""
    from splitmoe.sim.calibrate import _interleaved_medians

    calls = []

    def point(name: str, values: list[float]):
        def fn() -> float:
            calls.append(name)
            return values[len([c for c in calls if c == name]) % len(values)]

        return fn

    # (after the settling call, a's calls return 9, 2, 9, 3, 9, 1: each round's second is kept)
    got = _interleaved_medians({"a": point("a", [9.0, 1.0, 9.0, 2.0, 9.0, 3.0]),
                                "b": point("b", [7.0])}, 3)  # fmt: skip
    assert got == {"a": 2.0, "b": 7.0}
    assert calls[-12:] == ["a", "a", "b", "b"] * 3


def test_a_prefill_sequence_is_charged_its_attention_cost_once():
    """`fit_attention` on the seconds a known machine's attention layer takes: the fixed and
    per-sequence costs come back, and a prefill sequence's extra cost is what it costs beyond
    a decode sequence (the simulator charges every sequence along the curve), not both."""
    from splitmoe.sim.calibrate import ATTENTION_GRID_SEQS, ROOFLINE_CPU, fit_attention

    truth = Simulator(SHAPE, _cpu(COMPONENTS))
    decode = {b: truth._attn(b, b, 0, 32)[0] for b in ATTENTION_GRID_SEQS}
    prefill = {b: truth._attn(16 * b, 0, b, 8)[0] for b in (1, 4, 8)}
    fitted = fit_attention(Simulator(SHAPE, _cpu(Overheads())), decode, 32, prefill)
    assert fitted["attn_layer_s"] == pytest.approx(COMPONENTS.attn_layer_s, rel=1e-6)
    for n, t in fitted["seqs_layer_s"]:
        assert t == pytest.approx(COMPONENTS.seq_layer_s * n, rel=1e-6)
    assert fitted["prefill_seq_layer_s"] == pytest.approx(COMPONENTS.prefill_seq_layer_s, rel=1e-6)
    again = Simulator(SHAPE, _cpu(replace(COMPONENTS, seq_layer_s=0.0, seqs_layer_s=tuple(
        fitted["seqs_layer_s"]), prefill_seq_layer_s=fitted["prefill_seq_layer_s"])))  # fmt: skip
    for b, t in prefill.items():  # (a prefill chunk's layer, as measured)
        assert again._attn(16 * b, 0, b, 8)[0] == pytest.approx(t, rel=1e-6)
    assert ROOFLINE_CPU.overheads == Overheads()  # (the roofline `measure_components` fits over)


@pytest.mark.parametrize("name", ["qwen3_moe_dense"])
def test_components_measure_a_checkpoint(tiny_ckpt, name):
    """The in-process components of a real (tiny) checkpoint, a dense layer included: every
    constant measured is a non-negative number of seconds."""
    import math

    from splitmoe.models.config import ModelConfig
    from splitmoe.sim.calibrate import (
        ATTENTION_GRID_SEQS,
        ROOFLINE_CPU,
        expert_timed_tokens,
        measure_components,
    )

    comp = measure_components(tiny_ckpt(name), ROOFLINE_CPU)
    assert set(comp) == {"attn_layer_s", "seqs_layer_s", "prefill_seq_layer_s", "moe_layer_s",
                         "expert_s", "pair_s", "pairs_layer_s", "head_rows_s"}  # fmt: skip
    curve = comp.pop("seqs_layer_s")
    assert [n for n, _ in curve] == list(ATTENTION_GRID_SEQS)
    assert all(math.isfinite(t) and t >= 0.0 for _, t in curve)
    # one micro-batch's head and sampling, at every row count timed: a cost, never falling
    head = comp.pop("head_rows_s")
    assert [n for n, _ in head] == list(ATTENTION_GRID_SEQS)
    assert all(0.0 < a <= b for (_, a), (_, b) in zip(head, head[1:]))
    # the pairs' curve: what every timed call (decode-sized, then prefill-sized) measured
    pairs = comp.pop("pairs_layer_s")
    k = ModelConfig.from_hf(tiny_ckpt(name)).top_k
    assert [n for n, _ in pairs] == [n * k for n in expert_timed_tokens(k)]
    assert all(math.isfinite(t) and t >= 0.0 for _, t in pairs)
    assert all(math.isfinite(v) and v >= 0.0 for v in comp.values())
    assert comp["attn_layer_s"] + comp["moe_layer_s"] + comp["expert_s"] > 0.0
    Overheads(**comp, seqs_layer_s=curve, pairs_layer_s=pairs, head_rows_s=head)  # (as they are)


def _script(name: str):
    """``scripts/NAME.py`` as a module."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_kernel_fragment_from_rows_sets_the_efficiencies(tmp_path):
    """A synthetic run's rows, as an H100 would give them: the fragment keeps the best
    graph-timed paged-decode GB/s and the MoE kernels' best TFLOP/s per token count, and a
    profile takes efficiency = measured / its peak. No GPU."""
    import json

    from splitmoe.sim.calibrate import apply_kernel_fragment
    from splitmoe.sim.hardware import load_profile

    bk = _script("bench_kernels")
    Row = bk.Row
    rows = [
        Row("decode", "qwen3-235b-a22b", "B=8 ctx=8192", "triton", 0.2, 0.1, gbps=2000.0),
        Row("decode", "qwen3-235b-a22b", "B=64 ctx=8192", "triton", 0.9, 0.8, gbps=2814.0),
        Row("decode", "qwen3-235b-a22b", "B=64 ctx=8192", "torch-ref", 5.0, None, gbps=3300.0),
        Row("decode", "qwen3-235b-a22b", "B=1 ctx=1024", "triton", 0.05, None, gbps=3400.0),
        Row("moe", "deepseek-v3", "N=64", "triton", 0.5, 0.4, tflops=40.0),
        Row("moe", "deepseek-v3", "N=8192", "triton", 9.0, 8.9, tflops=300.0),
        Row("moe", "deepseek-v3", "N=8192", "grouped_mm", 8.0, 7.9, tflops=345.0),
        Row("moe", "deepseek-v3", "N=8192", "torch-ref", 50.0, None, tflops=900.0),
    ]
    frag = bk.profile_fragment(rows, "NVIDIA H100 80GB HBM3", "bfloat16", launch_s=9e-6)
    m = frag["measured"]
    # the torch reference and eager-only rows do not count (host-bound or not capturable)
    assert m["hbm_bytes_per_s"] == pytest.approx(2814e9)
    assert m["hbm_shape"] == "paged decode qwen3-235b-a22b B=64 ctx=8192"
    assert m["gemm_flops_by_tokens"] == {"64": pytest.approx(40e12), "8192": pytest.approx(345e12)}
    assert m["gemm_flops"] == pytest.approx(345e12) and m["launch_s"] == 9e-6
    path = tmp_path / "h100-kernels.json"
    path.write_text(json.dumps(frag))
    h100 = load_profile("h100")
    got = apply_kernel_fragment(h100, json.loads(path.read_text()))
    assert got.mem_efficiency == pytest.approx(2814e9 / 3.35e12)  # 0.84
    assert got.flops_efficiency == pytest.approx(345e12 / 989e12)  # 0.35
    assert got.overheads == h100.overheads  # launches: recorded, not applied
    assert got.source["measured"]["launch_s"] == 9e-6
    assert got.peak_flops == h100.peak_flops and got.links == h100.links
    # a fragment timed in another dtype leaves the 16-bit FLOP/s efficiency alone
    fp32 = apply_kernel_fragment(h100, {**frag, "dtype": "float32"})
    assert fp32.flops_efficiency == h100.flops_efficiency
    assert fp32.mem_efficiency == pytest.approx(got.mem_efficiency)
    with pytest.raises(ValueError, match="bench_kernels.py --profile-fragment"):
        apply_kernel_fragment(h100, {"measured": m})


def test_kernel_fragment_without_a_gpu_exits_cleanly(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the fragment would be measured")
    out = tmp_path / "frag.json"
    assert _script("bench_kernels").main(["--profile-fragment", str(out)]) == 0
    assert "no CUDA device" in capsys.readouterr().out and not out.exists()


def test_plan_takes_a_kernel_fragment(tmp_path, capsys):
    """``plan.py --profile FRAGMENT`` plans with the measured efficiencies: halving the HBM
    efficiency a fragment reports moves the plan's figures."""
    import importlib.util
    import json
    from pathlib import Path

    from splitmoe.sim.calibrate import KERNEL_FRAGMENT
    from splitmoe.sim.hardware import load_profile

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("plan", root / "scripts" / "plan.py")
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    args = ["--model", str(root / "splitmoe/sim/configs/qwen3-235b-a22b.json"), "--gpus", "16",
            "--tpot-slo", "50ms", "--quick", "--top", "1"]  # fmt: skip
    h100 = load_profile("h100")
    outs = []
    for eff in (h100.mem_efficiency, h100.mem_efficiency / 2):
        frag = {"kind": KERNEL_FRAGMENT, "dtype": "bfloat16",
                "measured": {"hbm_bytes_per_s": eff * h100.mem_bytes_per_s}}  # fmt: skip
        path = tmp_path / "frag.json"
        path.write_text(json.dumps(frag))
        assert plan.main([*args, "--profile", str(path)]) in (0, 1)
        outs.append(capsys.readouterr().out)
    assert outs[0] != outs[1]
    with pytest.raises(ValueError, match="not a kernel fragment"):
        path.write_text(json.dumps({"kind": "other"}))
        plan.main([*args, "--profile", str(path)])


def test_shipped_h200_fragment_plans(capsys):
    """The fragment an H200 measured (`profiles/measured/h200-kernels.json`) is one
    `plan.py --profile` takes: it sets the H200 profile's efficiencies to the measured ones
    (paged decode 4.11 TB/s of 4.8, grouped GEMM 376 TFLOP/s of 989 at 8192 tokens), and the
    planner prints a plan with them."""
    import json
    from pathlib import Path

    import splitmoe.sim.hardware as hardware
    from splitmoe.sim.calibrate import apply_kernel_fragment

    path = Path(hardware.__file__).parent / "profiles" / "measured" / "h200-kernels.json"
    frag = json.loads(path.read_text())
    assert frag["device"] == "NVIDIA H200" and frag["dtype"] == "bfloat16"
    got = apply_kernel_fragment(hardware.load_profile("h200"), frag)
    assert got.mem_efficiency == pytest.approx(4.108e12 / 4.8e12, rel=1e-3)
    assert got.flops_efficiency == pytest.approx(376.5e12 / 989e12, rel=1e-3)
    plan = _script("plan")
    argv = ["--model", "deepseek-v3", "--hardware", "h200", "--gpus", "64", "--tpot-slo", "50ms"]
    assert plan.main([*argv, "--quick", "--verdict", "--profile", str(path)]) == 0
    assert "AF: " in capsys.readouterr().out
