"""Token-exact greedy agreement with HF transformers (float32) with the Triton backends forced.

On CUDA the kernels compile; on CPU they run in Triton's interpreter (``TRITON_INTERPRET=1``, set
by conftest before triton is imported; the rank processes inherit it). A small token budget and
block size make the prompts arrive in chunks that do not line up with KV blocks, so one run
covers fresh prefill, chunks extending a cached prefix, decode, and batches mixing them.
"""

from __future__ import annotations

import os

import pytest
import torch
from tiny_models import prompt_ids

from splitmoe import LLM, SamplingParams

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="without CUDA the Triton backends run only under TRITON_INTERPRET=1 (tests/conftest.py)",
)

MAX_TOKENS = 12
PROMPTS = [prompt_ids(n, seed=i) for i, n in enumerate((1, 6, 23))]

# (checkpoint, attention_ranks, expert_ranks): colocated experts, and experts on their own rank.
CASES = [("qwen3_moe", 1, 0), ("mixtral", 1, 1)]


@pytest.mark.parametrize(
    "ckpt_name,attention_ranks,expert_ranks", CASES, ids=[f"{n}-{a}+{e}" for n, a, e in CASES]
)
def test_triton_greedy_matches_hf(ckpt_name, attention_ranks, expert_ranks, tiny_ckpt, hf_ref):
    ckpt = tiny_ckpt(ckpt_name)
    expected = [hf_ref(ckpt, p, MAX_TOKENS) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(
        str(ckpt),
        attention_ranks=attention_ranks,
        expert_ranks=expert_ranks,
        dtype="float32",
        device=DEVICE,
        block_size=4,
        max_num_batched_tokens=10,
        attention_backend="triton",
        moe_backend="triton",
    ) as llm:
        outs = llm.generate(PROMPTS, params)
    for i, (want, out) in enumerate(zip(expected, outs)):
        assert list(out.token_ids) == want, f"prompt {i} (len {len(PROMPTS[i])})"
