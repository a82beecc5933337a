"""The alpha-beta cost model and the adaptive rule, without processes."""

from __future__ import annotations

import pytest
import torch

from splitmoe.comm.cost_model import CostModel, LinkProfile, Phase
from splitmoe.comm.topology import Topology
from splitmoe.comm.two_phase import NodeLayout, scheme_times
from splitmoe.config import ParallelConfig

MODEL = CostModel(
    intra=LinkProfile(1.0, 1e3), inter=LinkProfile(2.0, 100.0), name="hand", phase_s=0.5
)
PURE = CostModel(intra=MODEL.intra, inter=MODEL.inter)


def test_phase_time_is_the_busiest_link():
    # sources 0, 1 on node 0; destinations on node 1
    phase = Phase(torch.tensor([[10, 0], [5, 5]]), torch.zeros(2, 2, dtype=torch.bool))
    # sender 0: 2 + 1000/100 = 12; sender 1: 2*2 + 10 = 14; receiver 0: 2*2 + 1500/100 = 19
    assert PURE.phase_time(phase, row_bytes=100) == 19.0
    # the same traffic inside one node: receiver 0: 2*1 + 1500/1000 = 3.5
    same = Phase(phase.rows, torch.ones(2, 2, dtype=torch.bool))
    assert PURE.phase_time(same, row_bytes=100) == 3.5


def test_scheme_time_sums_both_directions():
    phase = Phase(torch.tensor([[10, 0], [5, 5]]), torch.zeros(2, 2, dtype=torch.bool))
    # combine rows of 10 bytes: receiver 0: 2*2 + 150/100 = 5.5
    assert PURE.scheme_time([phase], 100, 10) == 19.0 + 5.5


def test_phase_s_is_paid_once_per_phase_that_moves_rows():
    model = CostModel(intra=MODEL.intra, inter=MODEL.inter, phase_s=100.0)
    phase = Phase(torch.tensor([[10, 0], [5, 5]]), torch.zeros(2, 2, dtype=torch.bool))
    idle = Phase(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.bool))
    assert model.scheme_time([phase, idle], 100, 10) == 19.0 + 5.5 + 2 * 100.0


def test_profile_file_round_trip(tmp_path):
    path = tmp_path / "profile.json"
    MODEL.to_file(path)
    assert CostModel.from_file(path) == MODEL
    (tmp_path / "bad.json").write_text('{"intra": {"alpha_s": 1, "bytes_per_s": 1}, "nvlink": 1}')
    with pytest.raises(ValueError, match="unknown keys"):
        CostModel.from_file(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="bytes_per_s"):
        LinkProfile(alpha_s=1e-6, bytes_per_s=0)


def test_default_model_switches_once_from_two_phase_to_flat():
    """8-GPU nodes: 16 attention ranks (2 nodes) + 16 expert ranks (2 nodes), hidden 7168 bf16,
    every attention rank sending ``t`` rows to every expert rank."""
    topo = Topology.build(0, ParallelConfig(16, 16, ranks_per_node=8), 256)
    lay = NodeLayout.build(topo)
    dispatch_bytes, combine_bytes = 7168 * 2 + 8 * 8, 7168 * 2
    choice = []
    for t in (2**i for i in range(13)):
        counts = torch.full((16, 16), t, dtype=torch.int64)
        times = scheme_times(lay, counts, dispatch_bytes, combine_bytes, CostModel())
        choice.append("two_phase" if times["two_phase"] < times["flat"] else "flat")
    assert choice[0] == "two_phase" and choice[-1] == "flat"
    switches = sum(a != b for a, b in zip(choice, choice[1:]))
    assert switches == 1, choice
