"""Issue 43 item 6: PD + AF deployments in the planner, against one AF pool and one colocated
pool, at a TTFT and a TPOT target (small search spaces: the simulator is called ~100 times)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from splitmoe.sim.hardware import load_profile
from splitmoe.sim.model import ModelShape
from splitmoe.sim.pd import (
    PDSpace,
    Workload,
    compare,
    one_pool,
    pd_plans,
    prefill_instance,
    table,
    transfer_bytes,
    transfer_seconds,
)
from splitmoe.sim.planner import CompareSpace
from splitmoe.sim.simulator import Deployment, Simulator

SPACE = PDSpace(
    compare=CompareSpace(
        attention_ranks=(8, 16),
        expert_ranks=(16,),
        micro_batches=(2,),
        colocated_sizes=(16,),
        colocated_micro_batches=(1,),
    ),
    prefill_sizes=(16,),
    prompts_per_step=(1, 2),
    batches=(8, 16, 32, 64),
)


@pytest.fixture(scope="module")
def sim() -> Simulator:
    return Simulator(ModelShape.from_config("qwen3-235b-a22b"), load_profile("h100"), skew=0.3)


def test_transfer_moves_every_layer_of_the_prompt(sim):
    m = sim.model
    assert transfer_bytes(sim, 1000) == 1000 * m.num_layers * m.kv_bytes_per_token(2)
    fast = transfer_seconds(sim, 1000, bandwidth=1e12)
    slow = transfer_seconds(sim, 1000, bandwidth=1e9)
    link = sim.hw.links.inter
    assert slow - fast == pytest.approx(transfer_bytes(sim, 1000) * (1e-9 - 1e-12))
    assert transfer_seconds(sim, 1000) == pytest.approx(
        link.alpha_s + transfer_bytes(sim, 1000) / link.bytes_per_s
    )


def test_a_sliding_window_layer_moves_its_window_only():
    gpt = Simulator(ModelShape.from_config("gpt-oss-120b"), load_profile("h100"))
    m = gpt.model
    assert m.sliding_layers and m.sliding_window < 8192
    full = 8192 * m.num_layers * m.kv_bytes_per_token(2)
    assert transfer_bytes(gpt, 8192) < full


def test_one_pool_pays_for_its_prompts_in_its_decode_steps(sim):
    wl = Workload(2048, 256, ttft_slo=5.0, tpot_slo=0.1)
    dep = Deployment(16, 0, 1, "gpu_a2a", expert_parallel=16)
    p = one_pool(sim, dep, wl, 16)
    pure = sim.decode(dep, 16, wl.context).step.t_step
    assert p.tpot_p99 > p.tpot > pure  # steps that carry a prompt chunk are slower
    assert 0 < p.prefill_load < 1
    # goodput: as many requests finish as the decode batch turns over
    assert p.requests_per_s == pytest.approx(16 * 16 / (256 * p.tpot))
    # 16 x 2048 / 256 = 128 prompt tokens a step: more than a budget of 140 leaves beside the
    # 16 decode tokens, so the rank cannot keep up
    assert one_pool(sim, dep, replace(wl, max_num_batched_tokens=200), 16) is not None
    assert one_pool(sim, dep, replace(wl, max_num_batched_tokens=140), 16) is None


def test_prefill_instances_trade_latency_for_capacity(sim):
    wl = Workload(2048, 256, ttft_slo=5.0, tpot_slo=0.1)
    one = prefill_instance(sim, 16, wl, 1)
    two = prefill_instance(sim, 16, wl, 2)
    assert two.latency > one.latency and two.capacity > one.capacity
    assert prefill_instance(sim, 16, wl, 8) is None  # 8 x 2048 tokens exceed the budget
    assert prefill_instance(sim, 1, wl, 1) is None  # 235B does not fit on one H100


def test_pd_plans_meet_both_targets_and_split_the_budget(sim):
    wl = Workload(2048, 256, ttft_slo=1.5, tpot_slo=0.05)
    plans = pd_plans(sim, wl, 64, SPACE)
    assert plans
    for p in plans:
        assert p.kind == "PD+AF" and p.prefill is not None
        assert p.ttft <= wl.ttft_slo and p.tpot <= wl.tpot_slo
        assert p.gpus <= 64 and p.prefill_instances >= 1 and p.decode_instances >= 1
        assert 0 < p.prefill_load <= 0.95
        assert p.transfer_s == pytest.approx(transfer_seconds(sim, 2048))
        assert p.tpot_p99 == p.tpot  # no prompt chunk in a decode instance's steps
    per_gpu = [p.per_gpu for p in plans]
    assert per_gpu == sorted(per_gpu, reverse=True)


def test_compare_gives_each_kind_and_a_verdict(sim):
    wl = Workload(2048, 256, ttft_slo=1.5, tpot_slo=0.05)
    v = compare(sim, 64, wl, SPACE)
    assert v.pd and v.af and v.colocated
    assert (v.pd.kind, v.af.kind, v.colocated.kind) == ("PD+AF", "AF", "colocated")
    for p in (v.pd, v.af, v.colocated):
        assert p.ttft <= wl.ttft_slo and p.tpot <= wl.tpot_slo and p.gpus <= 64
    assert v.plans[0].per_gpu == max(p.per_gpu for p in (v.pd, v.af, v.colocated))
    text = v.text()
    assert "PD+AF" in text and "single pool" in text
    assert len(table(v.plans, top=3).splitlines()) == 4


def test_a_p99_tpot_target_rules_out_pools_that_chunk_prompts(sim):
    """Held to the p99 (a step carrying a chunk), one pool loses to PD where the chunk's step
    is longer than the target; PD's TPOT has no chunk in it."""
    wl = Workload(2048, 256, ttft_slo=1.5, tpot_slo=0.05, tpot_of="p99")
    v = compare(sim, 64, wl, SPACE)
    assert v.pd is not None
    for p in (v.af, v.colocated):
        assert p is None or p.tpot_p99 <= 0.05


def test_a_slow_link_costs_pd_its_ttft(sim):
    wl = Workload(2048, 256, ttft_slo=1.5, tpot_slo=0.05)
    fast = pd_plans(sim, wl, 64, SPACE)
    slow = pd_plans(sim, wl, 64, SPACE, bandwidth=transfer_bytes(sim, 2048) / 2.0)  # 2 s each
    assert fast and not slow


def test_workload_is_checked():
    with pytest.raises(ValueError, match="tpot_of"):
        Workload(10, 10, 1.0, 0.1, tpot_of="p50")
    with pytest.raises(ValueError, match="slo"):
        Workload(10, 10, 0.0, 0.1)
    assert math.isclose(Workload(100, 50, 1, 1).context, 125)
