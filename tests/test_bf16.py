"""bfloat16 on CPU against HF transformers' bfloat16 run, on every family.

Tokens cannot be compared exactly in bfloat16 (two correct implementations round differently,
and a near-tie flips), so this compares log-probabilities: splitmoe (colocated, bfloat16, a few
greedy tokens with the top-5 logprobs) against HF's bfloat16 model teacher-forced on the same
prompt and tokens. Every logprob splitmoe reports must be within `TOL` of HF's for that token,
and each chosen token must be HF's argmax up to `TOL`.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import MLA_FAMILIES, prompt_ids

from splitmoe import LLM, SamplingParams

FAMILIES = (
    "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "minimax_m2", *MLA_FAMILIES,
    "gpt_oss",
)  # fmt: skip
NEW_TOKENS = 4
TOP = 5
# bfloat16 keeps 8 bits of mantissa (a relative step of 2^-8 = 0.4%): over the tiny models'
# 2-3 layers two implementations' logprobs differ by up to ~0.07 (GLM-4.5, Mixtral; which
# GEMM kernel the machine picks changes the rounding). A wrong cast, expert or scale moves
# them by tenths or more.
TOL = 0.15


def _hf_logprobs(ckpt, ids: list[int]) -> torch.Tensor:
    """HF bfloat16 log-probabilities of the next token after each prefix of ``ids``: [T, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]  # [T, V] bfloat16
    return logits.float().log_softmax(-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logprobs_match_hf_bf16(tiny_ckpt, family):
    ckpt = tiny_ckpt(family)
    prompt = prompt_ids(12, seed=5)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP)
    with LLM(str(ckpt), attention_ranks=1, expert_ranks=0, dtype="bfloat16", device="cpu") as llm:
        out = llm.generate([prompt], params)[0]
    assert len(out.token_ids) == NEW_TOKENS and len(out.logprobs) == NEW_TOKENS
    hf = _hf_logprobs(ckpt, prompt + out.token_ids)[len(prompt) - 1 : -1]  # [NEW_TOKENS, V]
    worst = 0.0
    for i, (token, (chosen, top)) in enumerate(zip(out.token_ids, out.logprobs)):
        assert top[0][0] == token, (i, token, top)
        gap = float(hf[i].max() - hf[i, token])
        assert gap <= TOL, (
            f"token {i}: {token} is {gap:.3f} below HF's argmax {int(hf[i].argmax())}"
        )
        for t, lp in [(token, chosen), *top]:
            err = abs(lp - float(hf[i, t]))
            worst = max(worst, err)
            assert err <= TOL, f"token {i}: logprob of {t} {lp:.4f}, HF {float(hf[i, t]):.4f}"
    print(f"{family}: worst logprob difference {worst:.4f}")
