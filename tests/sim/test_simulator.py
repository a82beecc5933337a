"""Simulator arithmetic: shapes, profiles, expert load, the step and overlap equations."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from splitmoe.sim.hardware import HardwareProfile, Overheads, load_profile
from splitmoe.sim.imbalance import expert_load, place
from splitmoe.sim.model import ModelShape
from splitmoe.sim.simulator import Deployment, Simulator, shared_cores_compute


def test_published_model_sizes():
    qwen = ModelShape.from_config("qwen3-235b-a22b")
    assert qwen.total_params / 1e9 == pytest.approx(235, rel=0.01)
    assert qwen.active_params / 1e9 == pytest.approx(22, rel=0.03)
    ds = ModelShape.from_config("deepseek-v3")
    assert ds.total_params / 1e9 == pytest.approx(671, rel=0.01)
    assert ds.active_params / 1e9 == pytest.approx(37, rel=0.03)
    assert (ds.attention, ds.num_moe_layers, ds.fp8_weights) == ("mla", 58, True)
    assert ds.kv_bytes_per_token(2) == (512 + 64) * 2  # the compressed latent, not 128 heads
    # GPT-OSS's config (sliding windows, YaRN, attention sinks) loads through its family parser
    oss = ModelShape.from_config("gpt-oss-120b")
    assert oss.total_params / 1e9 == pytest.approx(117, rel=0.01)
    # OpenAI's 5.1 B active leaves out the embedding table (0.58 B); the simulator counts it
    assert oss.active_params / 1e9 == pytest.approx(5.13 + 0.58, rel=0.01)
    # half its layers keep a 128-token window; its experts are MXFP4 (17 bytes per 32 weights)
    assert (oss.sliding_window, oss.sliding_layers, oss.mxfp4_experts) == (128, 18, True)
    assert oss.kv_context(8192) == pytest.approx((8192 + 128) / 2)
    assert oss.kv_context(100) == 100
    sim = Simulator(oss, load_profile("h100"))
    attn_gb, exp_gb = sim.memory_gb(Deployment(8, 8), 64, 8192)
    assert attn_gb * 1e9 == pytest.approx(
        oss.attention_rank_params * 2 + 64 * (8192 + 128) * 18 * oss.kv_bytes_per_token(2)
    )
    assert exp_gb * 1e9 == pytest.approx(36 * oss.expert_params * 17 / 32 * 16)


def test_supported_family_from_checkpoint_config(tmp_path):
    cfg = {
        "model_type": "mixtral", "vocab_size": 100, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 4096,  # changes no shape: accepted here, refused by the runtime
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = ModelShape.from_config(tmp_path)
    assert (m.num_experts, m.top_k, m.moe_intermediate, m.head_dim) == (4, 2, 32, 4)
    assert m.attn_params == 16 * (4 + 2 * 2) * 4 + 4 * 4 * 16
    with pytest.raises(FileNotFoundError, match="deepseek-v3"):
        ModelShape.from_config(tmp_path / "missing")


def test_profiles_load_and_round_trip(tmp_path):
    h100 = load_profile("h100")
    assert h100.gpus_per_node == 8 and h100.cores is None
    assert load_profile("h200").mem_bytes_per_s > h100.mem_bytes_per_s
    assert load_profile("cpu").cores >= 1
    path = tmp_path / "p.json"
    h100.to_file(path)
    assert load_profile(path) == h100
    bad = h100.to_dict() | {"nvlink": 1}
    with pytest.raises(ValueError, match="unknown keys"):
        HardwareProfile.from_dict(bad)
    with pytest.raises(FileNotFoundError, match="h100"):
        load_profile("tpu")


def test_collective_table_extrapolates():
    oh = Overheads(collective_s=(0.0, 1.0, 2.0), collective_slope_s=0.5)
    assert [oh.collective(w) for w in (1, 2, 3, 5)] == [0.0, 1.0, 2.0, 3.0]


def test_expert_load_uniform_skewed_and_balanced():
    flat = expert_load(4096, 64, 4, 8)
    assert flat.imbalance < 1.1
    assert flat.pairs_mean == pytest.approx(4096 * 4 / 8)
    assert 1 <= flat.rows_per_token <= 4
    skewed = expert_load(4096, 64, 4, 8, skew=1.0)
    balanced = expert_load(4096, 64, 4, 8, "global", 16, skew=1.0)
    assert skewed.imbalance > 1.3 and balanced.imbalance < skewed.imbalance
    recorded = expert_load(256, 4, 1, 2, recorded=(1.0, 1.0, 0.0, 0.0))
    assert recorded.imbalance == pytest.approx(2.0)  # every token lands on rank 0
    with pytest.raises(ValueError, match="balancer"):
        expert_load(8, 4, 1, 2, "static", 2)


def test_placement_replicates_the_hottest_expert():
    import torch

    replicas, slots = place(torch.tensor([8.0, 1.0, 1.0, 1.0]), 2, 2)
    assert replicas.tolist() == [3, 1, 1, 1]
    assert torch.bincount(slots[:, 1], minlength=2).tolist() == [3, 3]


def _roofline_only(**kw) -> HardwareProfile:
    return HardwareProfile(
        name="t", peak_flops=1e12, mem_bytes_per_s=1e11, memory_bytes=1e12, gpus_per_node=8,
        flops_efficiency=1.0, mem_efficiency=1.0, **kw,
    )  # fmt: skip


TINY = ModelShape(
    name="tiny", hidden=64, num_layers=2, num_moe_layers=2, vocab=128, num_experts=8, top_k=2,
    moe_intermediate=32, num_heads=4, num_kv_heads=2, head_dim=16,
)  # fmt: skip


def test_colocated_step_is_the_roofline_sum():
    hw = _roofline_only(weight_bytes=2)
    sim = Simulator(TINY, hw)
    st = sim.step(Deployment(1), decode_seqs=4, context=100)
    m = TINY
    attn = hw.gemm_s(
        2 * 4 * m.attn_params + 4 * m.attn_core_flops(100),
        m.attn_params * 2 + 4 * 100 * m.kv_bytes_per_token(2),
    )
    load = expert_load(4, 8, 2, 1)
    experts = hw.gemm_s(2 * 8 * m.expert_params, load.active_max * m.expert_params * 2)
    head = hw.gemm_s(2 * 4 * m.hidden * m.vocab, m.hidden * m.vocab * 2)
    assert st.t_comm == 0
    assert st.t_moe_layer == pytest.approx(attn + experts)
    assert st.t_step == pytest.approx(head + 2 * (attn + experts))


def test_uneven_micro_batches_cost_their_own_sizes():
    # 5 sequences in two micro-batches run as 3 + 2 (the runtime's split), not twice 2.5: the
    # distinct experts saturate with the tokens, so the uneven pair reads more weights
    oh = Overheads(moe_layer_s=1e-4, expert_s=2e-5, pair_s=1e-6)
    sim = Simulator(TINY, _roofline_only(overheads=oh, weight_bytes=2))
    st = sim.step(Deployment(1, micro_batches=2), 5, 10)
    three, two = expert_load(3, 8, 2, 1), expert_load(2, 8, 2, 1)
    pair = sim._experts(three.pairs_max, three.active_max) + sim._experts(
        two.pairs_max, two.active_max
    )
    assert st.t_expert == pytest.approx(pair)
    # an even split is the plain per-micro-batch cost
    even = expert_load(3, 8, 2, 1)
    st6 = sim.step(Deployment(1, micro_batches=2), 6, 10)
    assert st6.t_expert == pytest.approx(2 * sim._experts(even.pairs_max, even.active_max))


def test_small_loads_rest_on_enough_draws():
    # the expected distinct experts of 10 tokens on 4 of 32 (uniform): 32 (1 - (28/32)^10)
    expected = 32 * (1 - (28 / 32) ** 10)
    assert expert_load(10, 32, 4, 1).active_max == pytest.approx(expected, abs=0.5)


def test_weights_that_fit_in_cache_are_not_read_from_memory():
    hw = replace(_roofline_only(weight_bytes=2), mem_bytes_per_s=1e9)  # (weights dominate)
    model_bytes = TINY.total_params * 2
    out_of = Simulator(TINY, replace(hw, cache_bytes=model_bytes - 1)).step(Deployment(1), 4, 0)
    cached = Simulator(TINY, replace(hw, cache_bytes=model_bytes)).step(Deployment(1), 4, 0)
    load = expert_load(4, 8, 2, 1)
    flops_only = hw.gemm_s(2 * 8 * TINY.expert_params, 0)
    assert cached.t_expert == pytest.approx(flops_only)
    weights = load.active_max * TINY.expert_params * 2
    assert out_of.t_expert == pytest.approx(hw.gemm_s(2 * 8 * TINY.expert_params, weights))
    assert cached.t_step < out_of.t_step


def test_ping_pong_overlap():
    oh = Overheads(attn_layer_s=1e-3, moe_layer_s=1e-3, collective_s=(0.0, 2e-4, 2e-4))
    sim = Simulator(TINY, _roofline_only(overheads=oh))
    serial = sim.step(Deployment(2, 1), 8, 100)
    # m = 1: attention, experts and communication one after another
    assert serial.t_moe_layer == pytest.approx(serial.t_attn + serial.t_expert + serial.t_comm)
    assert serial.overlap_saved == pytest.approx(0.0)
    two = sim.step(Deployment(2, 1, micro_batches=2), 8, 100)
    # fixed per-layer costs are paid per micro-batch: each side is busy twice as long, but the
    # round trip of one micro-batch (3 ms) is what bounds the layer
    assert two.t_attn == pytest.approx(2 * serial.t_attn, rel=0.05)
    ta, te, tc = two.t_attn / 2, two.t_expert / 2, two.t_comm / 2
    assert two.t_moe_layer == pytest.approx(max(2 * ta, 2 * te, 2 * tc, ta + te + tc))
    assert two.t_moe_layer < two.t_attn + two.t_expert + two.t_comm and two.overlap_saved > 0
    # ranks that are host processes (with a core each) make their collective calls themselves:
    # 3 per micro-batch (counts, dispatch, combine) on each side, beside its compute
    host = Simulator(TINY, _roofline_only(overheads=oh, cores=8.0))
    ht = host.step(Deployment(2, 1, micro_batches=2), 8, 100)
    own = 3 * 2e-4
    assert ht.t_moe_layer == pytest.approx(max(2 * (ta + own), 2 * (te + own), ta + te + tc))
    assert host.step(Deployment(2, 1), 8, 100).t_moe_layer == pytest.approx(serial.t_moe_layer)


def test_empty_micro_batch_costs_its_layer_loop_only_colocated():
    oh = Overheads(attn_layer_s=1e-3, moe_layer_s=1e-3, empty_micro_batch_s=3e-4,
                   collective_s=(0.0, 2e-4))  # fmt: skip
    sim = Simulator(TINY, _roofline_only(overheads=oh))
    one, two = sim.step(Deployment(1), 1, 10), sim.step(Deployment(1, micro_batches=2), 1, 10)
    # one sequence in two micro-batches: the empty one runs every layer's ops on zero rows
    assert two.t_step - one.t_step == pytest.approx(TINY.num_layers * 3e-4)
    full = sim.step(Deployment(1, micro_batches=2), 2, 10)  # no empty micro-batch
    assert full.t_step == pytest.approx(
        replace(sim, hw=_roofline_only(overheads=replace(oh, empty_micro_batch_s=0.0)))
        .step(Deployment(1, micro_batches=2), 2, 10)
        .t_step
    )
    # an AF attention rank runs it while waiting for the other micro-batch's experts: hidden
    af = replace(sim, hw=_roofline_only(overheads=replace(oh, empty_micro_batch_s=0.0)))
    assert sim.step(Deployment(1, 1, micro_batches=2), 1, 10).t_step == pytest.approx(
        af.step(Deployment(1, 1, micro_batches=2), 1, 10).t_step
    )


def test_multi_process_costs_per_step_per_busy_rank_and_per_sequence_through_experts():
    oh = Overheads(attn_layer_s=1e-3, moe_layer_s=1e-3, collective_s=(0.0, 2e-4))
    base = Simulator(TINY, _roofline_only(overheads=oh))
    terms = replace(oh, proc_step_s=5e-4, busy_attention_step_s=1e-3, proc_seq_step_s=1e-4)
    sim = Simulator(TINY, _roofline_only(overheads=terms))

    def extra(dep: Deployment, seqs: int, share: float = 1.0) -> float:
        return (
            sim.step(dep, seqs, 10, load_share=share).t_step
            - base.step(dep, seqs, 10, load_share=share).t_step
        )

    assert extra(Deployment(1), 8) == pytest.approx(0.0)  # (one rank: in the driver's process)
    # two colocated ranks: the driver's step, and the wait for the slower of the two with work,
    # whatever their sequences; an idle second rank is waited for by nobody
    for seqs in (4, 30):
        assert extra(Deployment(2), seqs) == pytest.approx(5e-4 + 1e-3)
    assert extra(Deployment(2), 1, share=0.0) == pytest.approx(5e-4)
    # experts in other processes: every sequence of the instance pays its trips
    assert extra(Deployment(1, 1), 4) == pytest.approx(5e-4 + 4e-4)
    assert extra(Deployment(1, 1), 30) == pytest.approx(5e-4 + 30e-4)
    assert extra(Deployment(2, 1), 4) == pytest.approx(5e-4 + 1e-3 + 8e-4)


def test_attention_cost_of_the_sequences_follows_the_measured_curve(tmp_path):
    # the CPU calibration's points (n sequences, seconds beyond attn_layer_s), linear between
    # them from (0, 0) and along the last segment beyond; a line where none were measured
    oh = Overheads(
        attn_layer_s=1e-3, seq_layer_s=9.0, seqs_layer_s=[[1, 1e-4], [4, 4e-4], [16, 7e-4]]
    )
    assert [oh.seqs_layer(n) for n in (0, 0.5, 2.5, 4, 10, 32)] == pytest.approx(
        [0.0, 0.5e-4, 2.5e-4, 4e-4, 5.5e-4, 11e-4]
    )
    assert Overheads(seq_layer_s=1e-4).seqs_layer(3) == pytest.approx(3e-4)
    curved = _roofline_only(overheads=oh)
    line = _roofline_only(overheads=replace(oh, seqs_layer_s=(), seq_layer_s=1e-4))
    step = Simulator(TINY, curved).step(Deployment(1), 10, 10)
    assert step.t_attn - Simulator(TINY, line).step(Deployment(1), 10, 10).t_attn == (
        pytest.approx(5.5e-4 - 1e-3)
    )
    path = tmp_path / "p.json"
    curved.to_file(path)
    assert load_profile(path) == curved
    for bad in ([[0, 1e-4]], [[4, 1e-4], [2, 2e-4]], [[1, -1e-4]]):
        with pytest.raises(ValueError, match="seqs_layer_s"):
            Overheads(seqs_layer_s=bad)


def test_experts_cost_of_the_pairs_follows_the_measured_curve(tmp_path):
    # the CPU calibration's points (p pairs, seconds beyond moe_layer_s and expert_s each) in
    # place of pair_s * p: a prefill's many rows per expert cost less a pair than decode's few
    oh = Overheads(moe_layer_s=1e-4, pair_s=9.0, pairs_layer_s=[[4, 4e-4], [192, 19.2e-3],
                                                                 [1024, 10e-3]])  # fmt: skip
    assert [oh.pairs_layer(p) for p in (2, 98, 608, 2048)] == pytest.approx(
        [2e-4, 9.8e-3, 14.6e-3, 0.0]  # (past the last point along its segment, never < 0)
    )
    assert oh.pairs_layer(1440) == pytest.approx(10e-3 - 9.2e-3 * 416 / 832)
    assert Overheads(pair_s=1e-5).pairs_layer(100) == pytest.approx(1e-3)
    curved = Simulator(TINY, _roofline_only(overheads=oh))
    line = Simulator(TINY, _roofline_only(overheads=replace(oh, pairs_layer_s=(), pair_s=1e-5)))
    assert curved._experts(608, 8) - line._experts(608, 8) == pytest.approx(14.6e-3 - 6.08e-3)
    assert curved._experts(0, 0) == line._experts(0, 0) == pytest.approx(1e-4)
    path = tmp_path / "p.json"
    curved.hw.to_file(path)
    assert load_profile(path) == curved.hw
    for bad in ([[0, 1e-4]], [[8, 1e-4], [4, 2e-4]], [[4, -1e-4]]):
        with pytest.raises(ValueError, match="pairs_layer_s"):
            Overheads(pairs_layer_s=bad)


def test_contention_only_where_ranks_share_cores():
    oh = Overheads(attn_layer_s=1e-3, moe_layer_s=1e-3, seq_layer_s=1e-4, expert_s=1e-4)
    gpu = Simulator(TINY, _roofline_only(overheads=oh))
    cpu = Simulator(TINY, _roofline_only(overheads=oh, cores=2.0, oversubscribed=2.5))
    assert cpu.step(Deployment(2), 4, 10).t_step == pytest.approx(
        gpu.step(Deployment(2), 4, 10).t_step
    )
    # more rank processes than cores (colocated or not): the work that grows with the tokens
    # runs 2.5x slower, the fixed per-layer cost (1 ms each side) as before
    four_gpu, four_cpu = gpu.step(Deployment(4), 4, 10), cpu.step(Deployment(4), 4, 10)
    assert four_cpu.t_moe_layer - 2e-3 == pytest.approx(2.5 * (four_gpu.t_moe_layer - 2e-3))
    # ... of a side whose several ranks compute at once: a lone rank on its side is not slowed
    af_gpu, af_cpu = gpu.step(Deployment(1, 2), 4, 10), cpu.step(Deployment(1, 2), 4, 10)
    assert af_cpu.t_attn == pytest.approx(af_gpu.t_attn)
    assert af_cpu.t_expert - 1e-3 == pytest.approx(2.5 * (af_gpu.t_expert - 1e-3))
    fa_gpu, fa_cpu = gpu.step(Deployment(2, 1), 4, 10), cpu.step(Deployment(2, 1), 4, 10)
    assert fa_cpu.t_attn - 1e-3 == pytest.approx(2.5 * (fa_gpu.t_attn - 1e-3))
    assert fa_cpu.t_expert == pytest.approx(fa_gpu.t_expert)
    with pytest.raises(ValueError, match="oversubscribed"):
        _roofline_only(cores=2.0, oversubscribed=0.5)


def test_ranks_sharing_cores_take_turns():
    oh = Overheads(attn_layer_s=1e-3, moe_layer_s=1e-3, collective_s=(0.0, 2e-4),
                   wake_s=1e-4, shared_step_s=5e-4)  # fmt: skip
    cpu = Simulator(TINY, _roofline_only(overheads=oh, cores=2.0, oversubscribed=1.5))
    # 1 + 2 rank processes on 2 cores: they sleep while they wait, so the two micro-batches'
    # exchanges run one after the other; the compute takes turns on the 2 cores
    two = cpu.step(Deployment(1, 2, micro_batches=2), 8, 100)
    ta, te, tc = two.t_attn / 2, two.t_expert / 2, two.t_comm / 2
    assert ta > te  # (the attention rank is the bottleneck here)
    # it keeps its core; the two woken expert ranks share the other one (half speed)
    assert two.t_moe_layer == pytest.approx(2 * tc + 2 * max(ta, 2 * te))
    assert two.t_moe_layer == pytest.approx(2 * tc + shared_cores_compute(ta, te, 1, 2, 2, 2.0))
    assert two.t_moe_layer > max(2 * ta, 2 * te, ta + te + tc)  # (where ranks have cores)
    # ... each exchange wakes the 2 expert ranks and the attention rank, and every step wakes
    # the 3 ranks at its boundary; ranks with a core each do none of it
    one = cpu.step(Deployment(1, 2), 8, 100)
    unshared = replace(cpu, hw=replace(cpu.hw, cores=3.0, oversubscribed=1.0))
    one_own = unshared.step(Deployment(1, 2), 8, 100)
    assert one.t_comm - one_own.t_comm == pytest.approx(3 * 1e-4)
    per_token = one_own.t_attn + one_own.t_expert - 2e-3  # (less the fixed 1 ms each side)
    extra = 3 * 5e-4 + TINY.num_moe_layers * (3e-4 + 0.5 * per_token)
    assert one.t_step - one_own.t_step == pytest.approx(extra, rel=0.02)
    # an empty attention rank's answer is there before anyone waits: 2 attention ranks holding
    # one request between them wake as many ranks as one rank does
    two_a = cpu.run(Deployment(2, 2), 1, 4, 4).decode
    assert two_a.t_comm == pytest.approx(cpu.run(Deployment(1, 2), 1, 4, 4).decode.t_comm)
    two_own = unshared.step(Deployment(1, 2, micro_batches=2), 8, 100)
    assert two_own.overlap_saved > 0


def test_shared_cores_compute_the_bottleneck_keeps_its_cores():
    # 2 attention + 1 expert rank on 2 cores, the expert rank the bottleneck (3 s a micro-batch
    # against 1 s): it keeps its core, the two woken attention ranks share the other (each at
    # half speed, 2 s), beside it (measured so by scripts/trace_step.py on 2 cores)
    assert shared_cores_compute(1.0, 3.0, 2, 1, 2, 2.0) == pytest.approx(2 * 3.0)
    # ... until at half speed they take longer than it
    assert shared_cores_compute(2.0, 3.0, 2, 1, 2, 2.0) == pytest.approx(2 * 4.0)
    # 1 + 2: no core left; the woken attention rank's work takes turns with the experts'
    assert shared_cores_compute(1.0, 3.0, 1, 2, 2, 2.0) == pytest.approx(2 * (3.0 + 0.5))
    # the attention side the bottleneck on both cores: the woken expert rank takes turns too
    assert shared_cores_compute(3.0, 1.0, 2, 1, 2, 2.0) == pytest.approx(2 * (3.0 + 0.5))
    # one micro-batch: one side after the other; 4 attention ranks on 2 cores take turns
    assert shared_cores_compute(1.0, 3.0, 2, 1, 1, 2.0) == pytest.approx(4.0)
    assert shared_cores_compute(1.0, 3.0, 4, 1, 1, 2.0) == pytest.approx(2.0 + 3.0)
    # never faster than every rank's work over the cores
    for a, e, m in ((2, 1, 2), (1, 2, 2), (2, 2, 3), (4, 1, 2)):
        for ta, te in ((1.0, 3.0), (3.0, 1.0), (1.0, 1.0)):
            work = m * (a * ta + e * te) / 2.0
            assert shared_cores_compute(ta, te, a, e, m, 2.0) >= work - 1e-12


def test_global_balancer_all_gathers_counts_among_attention_ranks():
    oh = Overheads(collective_s=(0.0, 2e-4, 3e-4, 4e-4))
    sim = Simulator(TINY, _roofline_only(overheads=oh))
    load = expert_load(8, 8, 2, 2)
    for a, extra in ((1, 0.0), (2, 2e-4)):  # (one attention rank: nothing to gather)
        static, glob = Deployment(a, 2), Deployment(a, 2, balancer="global", redundant_experts=2)
        assert sim._comm(glob, 4, load) - sim._comm(static, 4, load) == pytest.approx(extra)
    # where ranks sleep (wake-ups counted), it also wakes the attention ranks that arrive first
    sleepy = Simulator(TINY, _roofline_only(overheads=replace(oh, wake_s=1e-4)))
    static, glob = Deployment(3, 2), Deployment(3, 2, balancer="global", redundant_experts=2)
    diff = sleepy._comm(glob, 4, load, wakes=5) - sleepy._comm(static, 4, load, wakes=5)
    assert diff == pytest.approx(oh.collective(3) + 2 * 1e-4)


def test_decode_throughput_and_memory():
    sim = Simulator(ModelShape.from_config("qwen3-235b-a22b"), load_profile("h100"))
    p = sim.decode(Deployment(8, 8, 2, "auto", "global", 8), 32, 2048)
    assert p.tokens_per_s == pytest.approx(8 * 32 / p.tpot)
    assert p.tokens_per_s_per_gpu == pytest.approx(p.tokens_per_s / 16)
    assert p.fits and 0 < p.step.comm_share < 1
    # all experts of a 235 B model on one expert rank cannot fit in 80 GB
    assert not sim.decode(Deployment(8, 1), 32, 2048).fits


def test_closed_batch_run():
    sim = Simulator(TINY, _roofline_only(overheads=Overheads(step_s=1e-3)))
    r = sim.run(Deployment(2, 1), num_requests=8, prompt_len=16, output_len=10)
    assert r.duration_s == pytest.approx(r.ttft + 9 * r.tbt)
    assert r.output_tok_s == pytest.approx(80 / r.duration_s)
    assert r.decode.tokens == 4 and r.prefill.tokens == 64
    assert math.isfinite(replace(sim, skew=0.5).run(Deployment(1), 1, 4, 2).tbt)
    # one request on two attention ranks: the second is empty, the experts see one token
    one, two = sim.run(Deployment(1, 1), 1, 16, 10), sim.run(Deployment(2, 1), 1, 16, 10)
    assert two.decode.t_expert == pytest.approx(one.decode.t_expert)
    assert sim.run(Deployment(2, 1), 2, 16, 10).decode.t_expert > one.decode.t_expert
