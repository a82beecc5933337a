"""Published results from their own setups, and what the planner's figures rest on: the KV-memory
bound, Pareto fronts, MTP, GPU-initiated all-to-all, heterogeneous GPUs, tensor parallelism."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from splitmoe.sim.hardware import load_profile
from splitmoe.sim.imbalance import expert_load
from splitmoe.sim.model import ModelShape
from splitmoe.sim.planner import closed_form_ratio, pareto_front, sweep_points
from splitmoe.sim.reproduce import (
    CONSTANTS,
    PREDICTED_KEYS,
    SEARCH_BATCHES,
    TOLERANCE,
    Row,
    best_under_slo,
    count,
    evaluate,
    load_cases,
    reproduce,
    sensitivity,
    sensitivity_table,
    simulator,
    table,
)
from splitmoe.sim.simulator import Deployment, Simulator


def test_every_case_names_its_source_and_loads():
    cases = load_cases()
    assert len(cases) >= 6
    for case in cases:
        assert case["source"]["url"].startswith("https://") and case["source"]["title"]
        simulator(case)  # its model config and hardware profile are shipped ones


@pytest.fixture(scope="module")
def rows():
    return reproduce()


def test_report_counts_cases_and_rows_of_predictions_only(rows):
    cases = load_cases()
    predicting = [c for c in cases if c["role"] == "prediction"]
    assert len(predicting) >= 6
    assert {c["file"] for c in cases if c["role"] == "calibration"} == {"deepep-low-latency.json"}
    assert {c["file"] for c in cases if c["role"] == "consistency"} == {"stepmesh.json"}
    lines = table(rows).splitlines()
    summary = next(line for line in lines if line.startswith("reproduced:"))
    m = re.fullmatch(r"reproduced: (\d+)/(\d+) cases \((\d+)/(\d+) rows\) within ±25%", summary)
    assert m, summary
    n, total, r, s = map(int, m.groups())
    counted = [row for row in rows if row.counted]
    assert total == len(predicting) and s == len(counted)
    assert r == sum(row.within for row in counted) and n <= total and r <= s
    # calibration and consistency rows are printed, marked, and left out of the count
    assert sum("(calibration: not counted)" in line for line in lines) == 12
    assert any(line.startswith("not counted (consistency): StepMesh") for line in lines)
    assert not any("MISS" in line and "not counted" in line for line in lines)


def test_count_is_per_case_and_per_row():
    rows = [
        Row("a", "f1", 100, 100, "x"),
        Row("a", "f2", 100, 200, "x"),  # a miss: case a is not reproduced
        Row("b", "f", 100, 110, "x"),
        Row("c", "f", 100, 500, "x", role="calibration"),  # not counted either way
        Row("d", "f", 100, 500, "x", role="consistency"),
    ]
    c = count(rows)
    assert (c.cases_within, c.cases, c.rows_within, c.rows) == (1, 2, 2, 3)
    assert c.text() == "reproduced: 1/2 cases (2/3 rows) within ±25%"
    assert c.missed == ("a",)


def _write_case(tmp_path, **over):
    case = {
        "name": "x", "kind": "throughput", "model": "deepseek-v3", "hardware": "h800",
        "source": {"title": "t", "url": "https://example.org", "where": "Table 1",
                   "figure": "100 tok/s", "checked": "read"},
        "from_source": {"hardware": "H800"}, "predicts": ["tok/s"],
    }  # fmt: skip
    case.update(over)
    (tmp_path / "c.json").write_text(json.dumps(case))


def test_a_case_may_not_take_what_the_simulator_predicts(tmp_path):
    _write_case(tmp_path, batch=64)
    with pytest.raises(ValueError, match="'batch' is what the simulator predicts"):
        load_cases(tmp_path)
    _write_case(tmp_path, batch=64, from_source={"batch": "Table 1: 64 per GPU"})
    assert load_cases(tmp_path)[0]["batch"] == 64  # a batch the source ran, cited
    _write_case(tmp_path, kind="ratio", baseline_max_batch=256,
                from_source={"baseline_max_batch": "engine default"})  # fmt: skip
    with pytest.raises(ValueError, match="ratio case may not fix 'baseline_max_batch'"):
        load_cases(tmp_path)
    _write_case(tmp_path, tpot_slo_ms="baseline")  # only a ratio has a baseline to match
    with pytest.raises(ValueError, match="'baseline' in a ratio case"):
        load_cases(tmp_path)
    for key in ("where", "figure", "checked"):
        _write_case(tmp_path, source={"title": "t", "url": "https://example.org", "where": "T1",
                                      "figure": "1", "checked": "y", key: ""})  # fmt: skip
        with pytest.raises(ValueError, match=f"source.{key} missing"):
            load_cases(tmp_path)


def test_ratio_cases_search_both_sides():
    """FastAFD: A:F, micro-batches and both batches come from the planner; the AF plan is no
    slower per token than the baseline's best at its KV bound (the case's stated assumption),
    on FP8 weights (an FP8 checkpoint of a family the runtime parses: one byte each)."""
    fp8, bf16 = (
        ModelShape.from_config("qwen3-235b-a22b-fp8"),
        ModelShape.from_config("qwen3-235b-a22b"),
    )
    assert fp8.fp8_weights and not bf16.fp8_weights
    case = next(c for c in load_cases() if c["file"] == "fastafd-qwen3-8k.json")
    assert not set(PREDICTED_KEYS) & set(case)
    (row,) = evaluate(case)
    sim = simulator(case)
    base = best_under_slo(sim, Deployment(**case["baseline"]), 8192, None)
    # throughput rises to the KV bound: the largest batch searched that fits
    assert base.batch == max(b for b in SEARCH_BATCHES if b <= sim.max_batch(base.deployment, 8192))
    best = None
    for a in case["deployment"]["attention_ranks"]:
        for m in case["deployment"]["micro_batches"]:
            p = best_under_slo(sim, Deployment(a, 4, m, "gpu_a2a"), 8192, base.tpot)
            if p and (best is None or p.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu):
                best = p
    assert best.tpot <= base.tpot and best.fits
    assert row.predicted == pytest.approx(best.tokens_per_s_per_gpu / base.tokens_per_s_per_gpu)
    for c in load_cases():
        assert "baseline_max_batch" not in c and (c["kind"] != "ratio" or "batch" not in c)


def test_sensitivity_table_scales_each_constant():
    hw = load_profile("h800")
    k2 = {name: scale(hw, 2.0) for name, scale in CONSTANTS.items()}
    assert k2["GEMM FLOP/s"].peak_flops == 2 * hw.peak_flops
    assert k2["GEMM FLOP/s"].fp8_flops == 2 * hw.fp8_flops
    assert k2["NIC bytes/s"].links.inter.bytes_per_s == 2 * hw.links.inter.bytes_per_s
    assert k2["NIC bytes/s"].links.intra == hw.links.intra
    assert k2["host overheads"].overheads.collective_s == tuple(
        2 * x for x in hw.overheads.collective_s
    )
    cases = [c for c in load_cases() if c["file"] == "deepseek-v3-profile.json"]
    base, results = sensitivity(cases, ("NIC bytes/s", "GPU memory"))
    assert (base.cases_within, base.cases) == (1, 1)
    nic, mem = results
    # communication binds this case: half the NIC bandwidth loses it; memory does not matter
    assert dict(nic.counts)[0.5].cases_within == 0
    assert dict(nic.counts)[0.5].missed == ("deepseek-v3-profile",)
    assert all(c.cases_within == 1 for _, c in mem.counts)
    text = sensitivity_table(base, results).splitlines()
    assert text[0].startswith("sensitivity: cases within ±25% with one constant scaled")
    assert text[1].split()[-4:] == ["x0.5", "x2", "cases", "missed"]
    assert re.fullmatch(r"NIC bytes/s\s+0/1 \(0/1\)\s+\d/1 \(\d/1\)  x0\.5: deepseek-v3-profile.*",
                        text[2])  # fmt: skip


def test_throughput_row_is_the_simulator_on_the_case_config():
    case = next(c for c in load_cases() if c["file"] == "deepseek-v3-profile.json")
    (row,) = evaluate(case)
    sim = Simulator(ModelShape.from_config("deepseek-v3"), load_profile("h800"))
    dep = Deployment(**case["deployment"])
    expect = sim.decode(dep, case["batch"], case["context"]).tokens_per_s_per_gpu
    assert row.predicted == pytest.approx(expect)
    assert row.ratio == pytest.approx(expect / 2324)


def test_rows_within_tolerance_and_budgets():
    assert Row("c", "f", 100, 100 * (1 + TOLERANCE) - 1e-9, "x").within
    assert not Row("c", "f", 100, 130, "x").within
    assert Row("c", "f", 273, 250, "us", budget=True).within
    assert not Row("c", "f", 273, 300, "us", budget=True).within


def test_case_without_a_source_is_refused(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps(
        {"name": "x", "source": {"title": "t"}, "kind": "throughput", "model": "deepseek-v3",
         "hardware": "h800", "from_source": {}, "predicts": []}))  # fmt: skip
    with pytest.raises(ValueError, match="source"):
        load_cases(tmp_path)


def test_deepseek_kv_cache_is_the_latent():
    ds = ModelShape.from_config("deepseek-v3")
    sim = Simulator(ds, load_profile("h800"))
    dep = Deployment(8, 8)
    per_seq = sim.memory_gb(dep, 1, 4096)[0] - sim.memory_gb(dep, 0, 4096)[0]
    assert per_seq * 1e9 == pytest.approx(4096 * 576 * 2 * 61)
    fp8 = replace(sim, kv_bytes=1)
    assert fp8.memory_gb(dep, 1, 4096)[0] - fp8.memory_gb(dep, 0, 4096)[0] == pytest.approx(
        per_seq / 2
    )


def test_kv_memory_bounds_the_batch():
    sim = Simulator(ModelShape.from_config("qwen3-235b-a22b"), load_profile("h100"))
    cap = sim.hw.memory_bytes / 1e9 * 0.9
    for dep in (Deployment(16, 16), Deployment(16, expert_parallel=16)):
        b = sim.max_batch(dep, 4096)
        assert sim.memory_gb(dep, b, 4096)[0] <= cap < sim.memory_gb(dep, b + 1, 4096)[0]
        best = best_under_slo(sim, dep, 4096, None)
        assert best.batch <= b and best.fits
    # attention ranks without experts hold more sequences than colocated ranks with a share
    assert sim.max_batch(Deployment(16, 16), 4096) > sim.max_batch(
        Deployment(16, expert_parallel=16), 4096
    )
    assert sim.max_batch(Deployment(16, 16), 16384) < sim.max_batch(Deployment(16, 16), 4096)


def test_pareto_front_is_monotone():
    sim = Simulator(ModelShape.from_config("step3"), load_profile("h800"))
    deps = [Deployment(a, 8, 2, "gpu_a2a") for a in (4, 8)] + [
        Deployment(16, 0, 2, "gpu_a2a", expert_parallel=16)
    ]
    pts = sweep_points(sim, deps, 4096, (8, 32, 128, 256))
    front = pareto_front(pts)
    assert 1 < len(front) <= len(pts)
    for a, b in zip(front, front[1:]):
        assert a.tpot <= b.tpot and a.tokens_per_s_per_gpu < b.tokens_per_s_per_gpu
    for p in pts:  # every point is matched or beaten by a front point no slower than it
        assert any(
            f.tpot <= p.tpot and f.tokens_per_s_per_gpu >= p.tokens_per_s_per_gpu for f in front
        )


def test_mtp_emits_more_tokens_per_step():
    base = Simulator(ModelShape.from_config("deepseek-v3"), load_profile("h800"))
    mtp = replace(base, draft_tokens=1, draft_acceptance=0.85)
    dep = Deployment(16, expert_parallel=16, micro_batches=2, transport="gpu_a2a")
    p0, p1 = base.decode(dep, 64, 4096), mtp.decode(dep, 64, 4096)
    assert mtp.tokens_per_step == pytest.approx(1.85)
    assert p1.tpot == pytest.approx(p1.step.t_step / 1.85)
    assert p1.step.t_step > p0.step.t_step  # two query tokens per sequence, the draft layer
    assert p1.tokens_per_s_per_gpu > p0.tokens_per_s_per_gpu


def test_gpu_a2a_bytes_and_links():
    sim = Simulator(ModelShape.from_config("deepseek-v3"), load_profile("h800"))
    hw = sim.hw
    # EP8 stays in the node (NVLink), EP16 sends half over the NIC
    d8, c8 = sim.gpu_a2a_times(1024, 1024, 0.0, 7 / 8)
    d16, _ = sim.gpu_a2a_times(1024, 1024, 0.5, 7 / 16)
    assert d8 == pytest.approx(hw.a2a_fixed_s + 1024 * (7168 + 224) * 7 / 8 / 150e9)
    assert d16 == pytest.approx(hw.a2a_fixed_s + 1024 * 7392 * 0.5 / 45e9)
    assert c8 > d8  # BF16 combine rows, FP8 dispatch rows
    load = expert_load(128 * 16, 256, 8, 16)
    st = sim.step(Deployment(16, expert_parallel=16, transport="gpu_a2a"), 128, 0.0)
    assert st.t_comm == pytest.approx(sum(sim.gpu_a2a_times(1024, load.pairs_max, 0.5, 7 / 16)))


def test_heterogeneous_expert_gpu():
    m = ModelShape.from_config("mixtral-8x22b")
    h20, l40s = load_profile("h20"), load_profile("l40s")
    homo = Simulator(m, h20)
    hetero = Simulator(m, h20, expert_hw=l40s)
    dep = Deployment(8, 8, 2, "gpu_a2a")
    a, b = homo.step(dep, 64, 2048), hetero.step(dep, 64, 2048)
    assert a.t_attn == pytest.approx(b.t_attn)
    assert b.t_expert > a.t_expert  # 864 GB/s GDDR6 against 4 TB/s HBM for the expert weights
    assert hetero.decode(dep, 64, 2048).expert_mem_gb < l40s.memory_bytes / 1e9
    # a colocated deployment runs its experts on the attention GPUs: the expert GPU is unused
    co = Deployment(8, 0, 2, "gpu_a2a", expert_parallel=8)
    assert hetero.decode(co, 64, 2048).tpot == pytest.approx(homo.decode(co, 64, 2048).tpot)


def test_tensor_parallel_baseline():
    sim = Simulator(ModelShape.from_config("mixtral-8x22b"), load_profile("a100"))
    tp = Deployment(8, attention_tp=8)
    p = sim.decode(tp, 64, 1024)
    assert p.tokens_per_s_per_gpu == pytest.approx(64 / p.tpot / 8)
    assert p.step.t_comm > 0  # the all-reduces
    assert sim.max_batch(tp, 1024) > 8 * sim.max_batch(Deployment(8, expert_parallel=8), 1024)
    with pytest.raises(ValueError, match="attention_tp"):
        Deployment(8, 8, attention_tp=8)


def test_closed_form_ratio_is_where_experts_catch_up():
    sim = Simulator(ModelShape.from_config("step3"), load_profile("h800"))
    r = closed_form_ratio(sim, 8, 64, 4096)
    a = round(r * 8)
    one = sim.step(Deployment(1, 8, 3, "gpu_a2a"), 64, 4096)
    limit = max(one.t_attn, one.t_comm, 3 * sim._experts(1.0, 6)) * 1.02  # 6 experts/rank
    below = sim.step(Deployment(a, 8, 3, "gpu_a2a"), 64, 4096)
    above = sim.step(Deployment(a + 1, 8, 3, "gpu_a2a"), 64, 4096)
    assert max(below.t_expert, below.t_comm) <= limit < max(above.t_expert, above.t_comm)
    assert 1 < a < 4096


def test_generic_config_of_an_unparsed_family(tmp_path):
    cfg = {"model_type": "some_moe", "hidden_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
           "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "intermediate_size": 128, "first_k_dense_replace": 1, "n_shared_experts": 1}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = ModelShape.from_config(tmp_path)
    assert (m.num_moe_layers, m.num_experts, m.shared_intermediate, m.head_dim) == (3, 8, 32, 16)
    del cfg["n_routed_experts"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="n_routed_experts"):
        ModelShape.from_config(tmp_path)


def test_step3_shape():
    s = ModelShape.from_config("step3")
    assert s.total_params / 1e9 == pytest.approx(316, rel=0.01)
    assert s.active_params / 1e9 == pytest.approx(38, rel=0.03)
    assert s.kv_bytes_per_token(1) == 2 * 256  # MFA: one K and one V head of 256
