"""End-to-end greedy generation over the two-phase and adaptive transports, on emulated nodes,
token-identical to HF transformers (float32)."""

from __future__ import annotations

import pytest
from tiny_models import prompt_ids

from splitmoe import LLM, SamplingParams

MAX_TOKENS = 16
PROMPTS = [prompt_ids(n, seed=i) for i, n in enumerate((1, 5, 17, 33, 9))]

# (transport, attention ranks, expert ranks, ranks per node)
CASES = [
    # nodes {0,1,2} attention, {3 | 4,5}: a mixed node whose attention rank reaches its experts
    # directly, the other node through proxies
    ("two_phase", 4, 2, 3),
    # nodes {0,1} {2,3} attention, {4,5} experts (at this hidden size the default NVLink/IB
    # model picks two-phase for every layer; tests/comm/test_two_phase.py covers the switch)
    ("auto", 4, 2, 2),
]


@pytest.mark.parametrize(
    "transport,A,E,g", CASES, ids=[f"{c[0]}-{c[1]}+{c[2]}-g{c[3]}" for c in CASES]
)
def test_greedy_matches_hf(transport, A, E, g, tiny_ckpt, hf_ref):
    ckpt = tiny_ckpt("qwen3_moe")
    expected = [hf_ref(ckpt, p, MAX_TOKENS) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(
        str(ckpt),
        attention_ranks=A,
        expert_ranks=E,
        transport=transport,
        ranks_per_node=g,
        dtype="float32",
        device="cpu",
    ) as llm:
        outs = llm.generate(PROMPTS, params)
    for i, (want, out) in enumerate(zip(expected, outs)):
        assert list(out.token_ids) == want, f"prompt {i} (len {len(PROMPTS[i])})"
