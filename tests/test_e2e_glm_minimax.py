"""GLM-4.5 MoE and MiniMax-M2 give HF transformers' greedy tokens (float32) beyond the plain
topologies of test_e2e_hf: expert replicas under the global balancer, two-phase transport and
ping-pong micro-batches in one 2+2 run, and the Triton backends (interpreter on CPU) in another.

The tiny checkpoints (tests/tiny_models.py) have what a runtime could silently get wrong: GLM's
partial rotary (half a head), qkv bias, per-head q/k norms, grouped sigmoid routing with a
random correction bias and routed_scaling_factor 2.5, a shared expert and a dense first layer;
MiniMax-M2's quarter-head rotary, q/k norms over the whole projections and sigmoid routing with
a random correction bias.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from tiny_models import cpu_llm, prompt_ids

from splitmoe import LLM, SamplingParams
from splitmoe.models.config import ModelConfig

FAMILIES = ("glm4_moe", "minimax_m2")
MAX_TOKENS = 10
PROMPTS = [prompt_ids(n, seed=500 + i) for i, n in enumerate((1, 6, 19, 11))]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def _check(outs, ckpt, hf_ref):
    for i, (p, o) in enumerate(zip(PROMPTS, outs)):
        assert list(o.token_ids) == hf_ref(ckpt, p, MAX_TOKENS), f"prompt {i} (len {len(p)})"


@pytest.mark.parametrize("family", FAMILIES)
def test_replicas_balancer_two_phase_micro_batches(family, tiny_ckpt, hf_ref):
    ckpt = tiny_ckpt(family)
    with cpu_llm(
        ckpt,
        2,
        2,
        redundant_experts=3,
        balancer="global",
        transport="two_phase",
        ranks_per_node=2,
        micro_batches=2,
        max_num_batched_tokens=16,
    ) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        load = llm.expert_load()
    _check(outs, ckpt, hf_ref)
    moe_layers = ModelConfig.from_hf(ckpt).moe_layers
    assert len(load["layers"]) == len(moe_layers)  # GLM: layer 0 is dense, not routed


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="without CUDA the Triton backends run only under TRITON_INTERPRET=1 (tests/conftest.py)",
)
@pytest.mark.parametrize("family", FAMILIES)
def test_triton_backends(family, tiny_ckpt, hf_ref):
    pytest.importorskip("triton")
    ckpt = tiny_ckpt(family)
    with LLM(
        str(ckpt),
        attention_ranks=1,
        expert_ranks=1,
        dtype="float32",
        device="cuda" if torch.cuda.is_available() else "cpu",
        block_size=4,
        max_num_batched_tokens=10,
        attention_backend="triton",
        moe_backend="triton",
    ) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
    _check(outs, ckpt, hf_ref)


def test_minimax_m2_fp8_release_format(tiny_ckpt, hf_ref, tmp_path):
    """MiniMax-M2 is released block-quantized like DeepSeek-V3 (float8_e4m3fn attention and
    expert weights, a weight_scale_inv per block): served in FP8, it generates HF's tokens for
    the dequantized weights."""
    from tiny_models import quantize_fp8_checkpoint

    fp8, dequant = quantize_fp8_checkpoint(
        tiny_ckpt("minimax_m2"), tmp_path / "fp8", tmp_path / "dequant", block=(16, 16)
    )
    with cpu_llm(fp8, 1, 1) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
    _check(outs, dequant, hf_ref)


def test_configs_parse_as_hf_reads_them(tiny_ckpt):
    """What each family's config.json means, against the released models' keys and HF's
    defaults for missing ones."""
    glm = ModelConfig.from_hf(tiny_ckpt("glm4_moe"))
    assert (glm.rotary_dim, glm.head_dim) == (16, 32)
    assert glm.moe_layers == (1, 2) and glm.shared_expert_intermediate_size == 32
    assert (glm.scoring_func, glm.topk_method, glm.n_group, glm.topk_group) == (
        "sigmoid",
        "noaux_tc",
        2,
        1,
    )
    assert glm.router_bias and glm.routed_scaling_factor == 2.5 and not glm.shared_expert_gate
    assert glm.qkv_bias and glm.qk_norm == "head"
    mm = ModelConfig.from_hf(tiny_ckpt("minimax_m2"))
    assert (mm.rotary_dim, mm.qk_norm, mm.scoring_func, mm.topk_method) == (
        8,
        "full",
        "sigmoid",
        "greedy",
    )
    assert mm.router_bias and mm.norm_topk_prob and mm.moe_layers == (0, 1)


def _write_config(tmp_path, **raw):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


GLM_RAW = dict(
    model_type="glm4_moe",
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
    intermediate_size=48,
    moe_intermediate_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
)


def test_released_style_configs(tmp_path):
    """Keys as the released config.json files spell them: GLM-4.5's top-level
    partial_rotary_factor (HF's default 0.5 when absent), MiniMax-M2's rotary_dim."""
    glm = ModelConfig.from_hf(_write_config(tmp_path, **GLM_RAW, partial_rotary_factor=0.25))
    assert glm.rotary_dim == 4 and glm.moe_layers == (1,)  # first_k_dense_replace defaults to 1
    glm = ModelConfig.from_hf(_write_config(tmp_path, **GLM_RAW))
    assert glm.rotary_dim == 8 and glm.rms_norm_eps == 1e-5 and glm.qk_norm == "none"
    mm = dict(GLM_RAW, model_type="minimax_m2", num_local_experts=4, head_dim=32, rotary_dim=16)
    del mm["n_routed_experts"]
    cfg = ModelConfig.from_hf(_write_config(tmp_path, **mm))
    assert (cfg.rotary_dim, cfg.rope_theta, cfg.moe_intermediate_size) == (16, 5e6, 48)


@pytest.mark.parametrize(
    "raw,match",
    [
        (dict(GLM_RAW, partial_rotary_factor=0.3125), r"rotary dims 5 .* must be even"),
        (dict(GLM_RAW, partial_rotary_factor=1.5), r"rotary dims 24 .* within head_dim=16"),
        (
            dict(GLM_RAW, model_type="minimax_m2", num_local_experts=4, qk_norm_type="per_head"),
            r"qk_norm_type='per_head' is not supported",
        ),
        (
            dict(GLM_RAW, model_type="minimax_m2", num_local_experts=4, shared_intermediate_size=8),
            r"shared_intermediate_size=8 is not supported",
        ),
    ],
)
def test_bad_configs_are_named(tmp_path, raw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(_write_config(tmp_path, **raw))
