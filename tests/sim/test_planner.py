"""The A:E planner on a tiny search space."""

from __future__ import annotations

import pytest

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


def test_verdict_matrix_sweeps_nic_and_baseline_width():
    from dataclasses import replace

    from splitmoe.sim.hardware import load_profile
    from splitmoe.sim.model import ModelShape
    from splitmoe.sim.planner import (
        CompareSpace,
        best_of,
        colocated_deployments,
        matrix_table,
        verdict_matrix,
    )
    from splitmoe.sim.simulator import Simulator

    (cell,) = verdict_matrix(("mixtral-8x22b",), ("h100",), nic_scales=(1.0, 2.0),
                             ep_widths=(4, 16))  # fmt: skip
    v = cell.verdict
    assert dict(cell.by_nic)[1.0] == v.gain
    assert dict(cell.by_ep)[4] == 0.0  # Mixtral's experts do not fit on 4 H100s beside the KV
    # the colocated baseline is its best over one and two micro-batches: with weight reads
    # binding, two micro-batches (each re-reading the experts) lose
    sim = Simulator(ModelShape.from_config("mixtral-8x22b"), load_profile("h100"), skew=0.3)
    space = CompareSpace()
    two = best_of(sim, colocated_deployments(64, replace(space, colocated_micro_batches=(2,))),
                  0.05, 4096, 64, space.batches)  # fmt: skip
    assert v.colocated.per_gpu > two.per_gpu
    width = v.colocated.prediction.deployment.expert_parallel
    narrow = best_of(sim, colocated_deployments(64, replace(space, colocated_sizes=(16,))), 0.05,
                     4096, 64, space.batches)  # fmt: skip
    assert dict(cell.by_ep)[16] == pytest.approx(v.af.per_gpu / narrow.per_gpu)
    assert width in space.colocated_sizes
    lines = matrix_table([cell]).splitlines()
    assert lines[0].split()[-6:] == ["NIC", "x2", "vs", "EP4", "vs", "EP16"]
    assert lines[1].startswith("mixtral-8x22b     h100") and lines[1].split()[-2] == "-"
