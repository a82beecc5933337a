"""Token-exact greedy agreement with HF transformers (float32), for every
supported MoE family and every topology (attention ranks + expert ranks).

One LLM per (checkpoint, topology); all prompts of different lengths (1 token
included) go through one ``generate`` call, so continuous batching of unequal
prompts is exercised too.
"""

from __future__ import annotations

import pytest
from tiny_models import FAMILIES, cpu_llm, prompt_ids

from splitmoe import SamplingParams
from splitmoe.models.config import ModelConfig

MAX_TOKENS = 24
PROMPT_LENGTHS = (1, 5, 17, 33)
PROMPTS = [prompt_ids(n, seed=i) for i, n in enumerate(PROMPT_LENGTHS)]

# (attention_ranks, expert_ranks); expert_ranks=0 means experts colocated.
TOPOLOGIES = [(1, 0), (1, 1), (1, 2), (2, 2)]

# The CPU build's backends: "auto" (the PyTorch kernels on CPU), named explicitly here so
# these tests run the PyTorch path whatever "auto" becomes; the Triton kernels run under the
# interpreter in test_e2e_triton.py.
CASES = [(fam, a, e, "torch") for fam in FAMILIES for (a, e) in TOPOLOGIES]
# A 3-layer Qwen3-MoE whose layer 0 is dense (mlp_only_layers=[0]).
CASES += [("qwen3_moe_dense", 1, 0, "torch"), ("qwen3_moe_dense", 1, 2, "torch")]


@pytest.mark.parametrize(
    "ckpt_name,attention_ranks,expert_ranks,backend",
    CASES,
    ids=[f"{n}-{a}+{e}-{b}" for n, a, e, b in CASES],
)
def test_greedy_matches_hf(ckpt_name, attention_ranks, expert_ranks, backend, tiny_ckpt, hf_ref):
    ckpt = tiny_ckpt(ckpt_name)
    expected = [hf_ref(ckpt, p, MAX_TOKENS) for p in PROMPTS]

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with cpu_llm(
        ckpt, attention_ranks, expert_ranks, attention_backend=backend, moe_backend=backend
    ) as llm:
        outs = llm.generate(PROMPTS, params)
        stats = llm.stats()
    assert {s["attention_backend"] for s in stats if s["role"] == "attention"} == {backend}
    assert {s["moe_backend"] for s in stats} - {None} == {backend}
    # KV-cache bytes per token: a key and a value per KV head, layer and token (float32)
    cfg = ModelConfig.from_hf(ckpt)
    want_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    assert {s["kv_cache_bytes_per_token"] for s in stats if s["role"] == "attention"} == {
        want_bytes
    }

    assert len(outs) == len(PROMPTS)
    for i, (prompt, want, out) in enumerate(zip(PROMPTS, expected, outs)):
        assert out.prompt_token_ids == prompt, f"prompt {i}: outputs not in prompt order"
        got = list(out.token_ids)
        if got != want:
            first = next(
                (k for k, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want))
            )
            pytest.fail(
                f"prompt {i} (len {len(prompt)}): first mismatch at generated position {first}\n"
                f"  splitmoe: {got}\n  HF:       {want}"
            )
        assert out.finish_reason == "length"


@pytest.mark.parametrize("attention_ranks,expert_ranks,threads", [(1, 0, 3), (1, 1, 2)])
def test_threads_match_hf(attention_ranks, expert_ranks, threads, tiny_ckpt, hf_ref):
    """Ranks whose kernels split their rows over several threads (more than this machine's
    cores, too) still give HF's tokens: 10 sequences decode at once, so the rows are split."""
    ckpt = tiny_ckpt("qwen3_moe")
    prompts = [prompt_ids(3 + 2 * i, seed=100 + i) for i in range(10)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with cpu_llm(ckpt, attention_ranks, expert_ranks, threads_per_rank=threads) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.stats()
    assert [list(o.token_ids) for o in outs] == [hf_ref(ckpt, p, 12) for p in prompts]
    assert all(s["threads"] == threads for s in stats)
