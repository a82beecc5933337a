"""`LocalExperts.stage` / `apply` growing a rank's slots (fault tolerance: a survivor that
takes a lost rank's experts into new slots): the held slots keep or change their experts in
place, the new ones are appended, and the result is what loading those experts afresh gives,
in the run dtype and in a released FP8 layout."""

from __future__ import annotations

import pytest
import torch
from tiny_models import quantize_fp8_checkpoint

from splitmoe.expert_nodes.experts import LocalExperts
from splitmoe.kernels.backends import moe_backend
from splitmoe.kernels.quant import QuantizedWeight
from splitmoe.models.config import ModelConfig

CPU = torch.device("cpu")


def _same(a, b) -> bool:
    if isinstance(a, QuantizedWeight):
        return torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(
            a.scale, b.scale
        )
    return torch.equal(a, b)


@pytest.mark.parametrize("layout", ["float32", "fp8"])
def test_apply_appends_new_slots(tiny_ckpt, tmp_path, layout):
    ckpt = tiny_ckpt("qwen3_moe")
    if layout == "fp8":
        ckpt, _ = quantize_fp8_checkpoint(ckpt, tmp_path / "fp8", tmp_path / "dq", block=(16, 16))
    cfg = ModelConfig.from_hf(ckpt)
    layer = cfg.moe_layers[0]
    backend = moe_backend("torch", CPU)
    experts = LocalExperts(cfg, {layer: [0, 1, 2]}, torch.float32, CPU, backend)
    staged = experts.stage({layer: [0, 5, 2, 6, 7]})
    assert staged.changed == {layer: [1, 3, 4]}
    assert experts.apply(staged, layer) == 3
    want = LocalExperts(cfg, {layer: [0, 5, 2, 6, 7]}, torch.float32, CPU, backend)
    assert experts.layer_experts == want.layer_experts
    assert all(_same(a, b) for a, b in zip(experts.weights[layer], want.weights[layer]))
    assert experts.weight_bytes == want.weight_bytes


def test_slots_are_never_taken_away(tiny_ckpt):
    cfg = ModelConfig.from_hf(tiny_ckpt("qwen3_moe"))
    layer = cfg.moe_layers[0]
    experts = LocalExperts(cfg, {layer: [0, 1, 2]}, torch.float32, CPU, moe_backend("torch", CPU))
    with pytest.raises(ValueError, match="never taken away"):
        experts.stage({layer: [0, 1]})
