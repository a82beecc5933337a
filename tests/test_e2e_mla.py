"""DeepSeek-V3 / V2 (multi-head latent attention, grouped sigmoid / softmax routing, shared
experts, a dense first layer) token-exact against HF transformers in float32, on the one path:
every topology, replicas with the global balancer, two-phase transport, micro-batches, chunked
prefill that does not line up with KV blocks, and preemption.

Checkpoints (tests/conftest.py): ``deepseek_v3`` has q LoRA, YaRN with an mscale correction,
interleaved rotary and attention biases; ``deepseek_v3_nolora`` plain q_proj, default rope, the
halves rotary layout; ``deepseek_v2`` no q LoRA, group-limited softmax routing. All have non-zero
biases, correction biases and norm weights.
"""

from __future__ import annotations

import pytest
from tiny_models import KV_LORA_RANK, ROPE_DIM, cpu_llm, prompt_ids

from splitmoe import SamplingParams
from splitmoe.models.config import ModelConfig

MAX_TOKENS = 16
PROMPTS = [prompt_ids(n, seed=i) for i, n in enumerate((1, 5, 17, 33))]

# replicas of hot experts, the global balancer, two nodes of two ranks, two micro-batches
EVERYTHING = dict(
    redundant_experts=2, balancer="global", transport="two_phase", ranks_per_node=2,
    micro_batches=2,
)  # fmt: skip
# chunks across block boundaries (1+1 with the Triton kernels below)
CHUNKED = dict(block_size=4, max_num_batched_tokens=10)
PREEMPT = dict(block_size=4, num_kv_blocks=14)  # too few blocks for every sequence at once

TRITON = dict(CHUNKED, attention_backend="triton", moe_backend="triton")
LABELS = {id(EVERYTHING): "everything", id(CHUNKED): "chunked", id(PREEMPT): "preempt"}
CASES = [
    ("deepseek_v3", 1, 0, {}),
    ("deepseek_v3", 1, 2, PREEMPT),
    ("deepseek_v3", 2, 2, EVERYTHING),
    ("deepseek_v3_nolora", 1, 0, CHUNKED),
    ("deepseek_v3_nolora", 2, 2, EVERYTHING),
    ("deepseek_v2", 1, 2, {}),
    ("deepseek_v2", 2, 2, EVERYTHING),
    # the Triton kernels (MLA decode and prefill/extend, fused MoE), under the interpreter on CPU
    ("deepseek_v3", 1, 1, TRITON),
]
LABELS[id(TRITON)] = "triton"


@pytest.mark.parametrize(
    "name,attention_ranks,expert_ranks,options",
    CASES,
    ids=[f"{n}-{a}+{e}-{LABELS.get(id(o), 'plain')}" for n, a, e, o in CASES],
)
def test_mla_greedy_matches_hf(name, attention_ranks, expert_ranks, options, tiny_ckpt, hf_ref):
    ckpt = tiny_ckpt(name)
    expected = [hf_ref(ckpt, p, MAX_TOKENS) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    if options.get("attention_backend") == "triton":
        pytest.importorskip("triton")
    with cpu_llm(ckpt, attention_ranks, expert_ranks, **options) as llm:
        outs = llm.generate(PROMPTS, params)
        stats = llm.stats()
        metrics = llm.metrics() if options is PREEMPT else None
    for i, (want, out) in enumerate(zip(expected, outs)):
        assert list(out.token_ids) == want, f"prompt {i} (len {len(PROMPTS[i])})"
    # the latent cache: kv_lora_rank + qk_rope_head_dim float32 values per token and layer
    cfg = ModelConfig.from_hf(ckpt)
    per_token = cfg.num_layers * (KV_LORA_RANK + ROPE_DIM) * 4
    assert cfg.kv_bytes_per_token(4) == per_token
    assert {s["kv_cache_bytes_per_token"] for s in stats if s["role"] == "attention"} == {per_token}
    if metrics is not None:
        assert metrics.num_preemptions > 0


def test_fp8_block_quantized_checkpoint_matches_hf(tiny_ckpt, hf_ref, tmp_path):
    """DeepSeek-V3's released format (float8_e4m3fn projections with a weight_scale_inv per
    block, here 16x16 so that the tiny weights span several blocks, partial ones included):
    the attention and expert ranks keep them in FP8 (`QuantizedWeight`) and generate HF's tokens
    for the dequantized weights."""
    from tiny_models import quantize_fp8_checkpoint

    fp8, dequant = quantize_fp8_checkpoint(
        tiny_ckpt("deepseek_v3"), tmp_path / "fp8", tmp_path / "dequant", block=(16, 16)
    )
    cfg = ModelConfig.from_hf(fp8)
    assert (cfg.quantization, cfg.weight_block_size) == ("fp8", (16, 16))
    expected = [hf_ref(dequant, p, MAX_TOKENS) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with cpu_llm(fp8, 1, 1) as llm:
        outs = llm.generate(PROMPTS, params)
    assert [list(o.token_ids) for o in outs] == expected
