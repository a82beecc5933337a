"""The A:E planner on a tiny search space."""

from __future__ import annotations

from splitmoe.sim.hardware import load_profile
from splitmoe.sim.model import ModelShape
from splitmoe.sim.planner import SearchSpace, search, table
from splitmoe.sim.simulator import Simulator


def test_planner_finds_plans_under_the_slo():
    sim = Simulator(ModelShape.from_config("qwen3-235b-a22b"), load_profile("h100"), skew=0.3)
    space = SearchSpace(
        attention_ranks=(4, 8),
        expert_ranks=(8,),
        micro_batches=(1, 2),
        transports=("flat", "auto"),
        balancers=(("static", 0), ("global", 1)),
        colocated_sizes=(16,),
        batches=(8, 16, 32, 64),
    )
    disagg, colocated = search(sim, gpus=32, tpot_slo=0.1, context=2048, space=space)
    assert disagg and colocated
    for plan in disagg + colocated:
        p = plan.prediction
        assert p.tpot <= 0.1 and p.fits and p.deployment.gpus <= 32
    per_gpu = [p.per_gpu for p in disagg]
    assert per_gpu == sorted(per_gpu, reverse=True)
    assert all(p.prediction.deployment.colocated for p in colocated)
    text = table(disagg, "disaggregated", top=3)
    assert len(text.splitlines()) == 4 and "A:8E" in text


def test_impossible_slo_gives_no_plan():
    sim = Simulator(ModelShape.from_config("deepseek-v3"), load_profile("h100"))
    space = SearchSpace(
        attention_ranks=(8,), expert_ranks=(16,), micro_batches=(1,), transports=("flat",),
        balancers=(("static", 0),), colocated_sizes=(32,), batches=(1, 8),
    )  # fmt: skip
    assert search(sim, 32, tpot_slo=1e-4, context=1024, space=space) == ([], [])
