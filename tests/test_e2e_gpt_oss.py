"""GPT-OSS: token-exact greedy agreement with HF transformers (float32) on a tiny checkpoint
with non-zero attention/router/expert biases and sinks, a sliding window (8 keys) shorter than
the prompts, the clamped SwiGLU reached, and YaRN RoPE; in the layout ``save_pretrained``
writes and in the released MXFP4 expert format.

Few launched jobs, each covering several features: small blocks and a small token budget make
prompts arrive in chunks that straddle blocks and windows.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from quant_models import write_mxfp4_checkpoint
from tiny_models import cpu_llm, hf_greedy, prompt_ids

from splitmoe import LLM, SamplingParams
from splitmoe.models.config import ModelConfig

MAX_TOKENS = 20
PROMPTS = [prompt_ids(n, seed=40 + i) for i, n in enumerate((1, 6, 19, 33))]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SMALL = dict(block_size=4, max_num_batched_tokens=12)

TRITON = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
# (attention_ranks, expert_ranks, options)
CASES = [
    (1, 0, SMALL),
    (1, 2, dict(SMALL, redundant_experts=4, balancer="global")),
    (2, 2, dict(micro_batches=2, ranks_per_node=2, transport="two_phase")),
]
if TRITON:
    CASES.append((1, 1, dict(SMALL, attention_backend="triton", moe_backend="triton")))


def _check(outs, expected):
    for i, (want, out) in enumerate(zip(expected, outs)):
        assert list(out.token_ids) == want, f"prompt {i} (len {len(PROMPTS[i])})"


@pytest.mark.parametrize(
    "attention_ranks,expert_ranks,options",
    CASES,
    ids=[
        f"{a}+{e}-" + "-".join(f"{k}={v}" for k, v in o.items() if k not in SMALL)
        for a, e, o in CASES
    ],
)
def test_greedy_matches_hf(attention_ranks, expert_ranks, options, tiny_ckpt, hf_ref):
    ckpt = tiny_ckpt("gpt_oss")
    cfg = ModelConfig.from_hf(ckpt)
    assert cfg.sliding_layers == (0,) and cfg.sliding_window < max(map(len, PROMPTS))
    expected = [hf_ref(ckpt, p, MAX_TOKENS) for p in PROMPTS]
    with cpu_llm(ckpt, attention_ranks, expert_ranks, **options) as llm:
        _check(llm.generate(PROMPTS, GREEDY), expected)
        stats = [s for s in llm.stats() if s["role"] == "attention"]
    for s in stats:  # the sliding layer's blocks were freed as the window moved on
        bs = options.get("block_size", 16)
        budget = options.get("max_num_batched_tokens", 2048)
        bound = len(PROMPTS) * ((cfg.sliding_window - 1) // bs + 2) + -(-budget // bs)
        assert 0 < s["kv_window_blocks_peak"] <= bound and s["kv_window_blocks_used"] == 0
    if options == SMALL:  # 4 requests of up to 53 tokens held at most 15 blocks (vs 37 full)
        assert stats[0]["kv_window_blocks_peak"] < sum(
            -(-(len(p) + MAX_TOKENS - 1) // 4) for p in PROMPTS
        )


def test_mxfp4_checkpoint_matches_hf_on_dequantized_weights(tiny_ckpt, tmp_path):
    quant, plain = write_mxfp4_checkpoint(tiny_ckpt("gpt_oss"), tmp_path)
    assert ModelConfig.from_hf(quant).quantization == "mxfp4"
    expected = [hf_greedy(plain, p, MAX_TOKENS) for p in PROMPTS]
    with cpu_llm(quant, 1, 1, **SMALL) as llm:  # experts on their own rank: per-role loads
        _check(llm.generate(PROMPTS, GREEDY), expected)


def test_unsupported_quantization_is_named_before_ranks_start(tiny_ckpt, tmp_path):
    d = tmp_path / "fp8"
    shutil.copytree(tiny_ckpt("gpt_oss"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization method 'awq' is not supported"):
        LLM(str(d), device="cpu", expert_ranks=1)
    cfg["quantization_config"] = None
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope type 'longrope' is not supported"):
        LLM(str(d), device="cpu")
