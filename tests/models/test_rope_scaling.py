"""Rope scaling (`splitmoe.models.rope`) against HF transformers, and the config errors a user
gets before any rank starts for a rope type or quantization method splitmoe cannot run."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

from splitmoe import LLM
from splitmoe.models.config import ModelConfig
from splitmoe.models.rope import parse_rope, rope_inv_freq, yarn_softmax_scale

# DeepSeek-V3's released rope_scaling (old "type" spelling), and variants
V3_YARN = {
    "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096, "type": "yarn",
}  # fmt: skip
YARNS = [
    V3_YARN,
    dict(V3_YARN, mscale=0.707, mscale_all_dim=0.8, factor=4.0),
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
     "attention_factor": 1.3, "beta_fast": 16, "truncate": False},
    {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "default"},
]  # fmt: skip


def ours(rope: dict, max_pos=163840, theta=10000.0):
    raw = {"rope_scaling": dict(rope, rope_theta=theta), "max_position_embeddings": max_pos}
    fields = parse_rope(raw, "config.json")
    base = dict(
        path="/x", model_type="deepseek_v3", vocab_size=8, hidden_size=64, num_layers=1,
        num_heads=1, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-6, num_experts=2, top_k=1,
        moe_intermediate_size=8, norm_topk_prob=True, moe_layers=(0,),
        max_position_embeddings=max_pos,
    )  # fmt: skip
    return ModelConfig(**base, **fields)


@pytest.mark.parametrize("rope", YARNS, ids=range(len(YARNS)))
def test_rope_parameters_match_hf(rope):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    hf_cfg = DeepseekV3Config(
        hidden_size=64, num_attention_heads=2, qk_rope_head_dim=64, qk_nope_head_dim=32,
        v_head_dim=16, kv_lora_rank=16, q_lora_rank=None, max_position_embeddings=163840,
        rope_scaling=dict(rope), rope_theta=10000.0,
    )  # fmt: skip
    emb = DeepseekV3RotaryEmbedding(hf_cfg)
    cfg = ours(rope)
    inv_freq, factor = rope_inv_freq(cfg, 64)
    assert torch.equal(inv_freq, emb.inv_freq)
    assert factor == emb.attention_scaling
    scaling = DeepseekV3Attention(hf_cfg, 0).scaling
    assert yarn_softmax_scale(cfg, (32 + 64) ** -0.5) == pytest.approx(scaling, rel=1e-12)


def _write(tmp_path, **changes):
    cfg = {
        "model_type": "deepseek_v3", "vocab_size": 128, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "intermediate_size": 96, "kv_lora_rank": 32, "q_lora_rank": None,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "n_group": 4,
        "topk_group": 2, "first_k_dense_replace": 1, "n_shared_experts": 1,
    }  # fmt: skip
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"rope type 'dynamic'"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, r"'longrope'"),
        ({"quantization_config": {"quant_method": "awq"}}, r"quantization method 'awq'"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"weight_block_size"),
        ({"topk_method": "bogus"}, None),  # V3 routes by noaux_tc whatever it says, as HF
        ({"n_group": 3}, r"n_group=3"),
        ({"moe_layer_freq": 2}, r"moe_layer_freq=2"),
    ],
)
def test_bad_config_is_an_error_before_any_rank(tmp_path, changes, match):
    path = _write(tmp_path, **changes)
    if match is None:
        assert ModelConfig.from_hf(path).topk_method == "noaux_tc"
        return
    with pytest.raises(ValueError, match=match):
        LLM(str(path), device="cpu")
    assert not multiprocessing.active_children()
