"""Token-exact greedy agreement with HF transformers (float32) with decode replayed from CUDA
graphs (``enforce_eager=False``: the compiled pieces, every decode step of one micro-batch from
the captured bucket at or above its batch, padded, and the experts' FFN per layer from theirs).
Needs a GPU: without one the option captures nothing (`tests/attention_nodes/test_graphs.py`
and `tests/expert_nodes/test_expert_graphs.py` check the no-op and the static-buffer plumbing on
CPU), so these tests are skipped;
`scripts/gpu_check.sh` runs them on a lent GPU.

Five prompts of different lengths decode as five sequences, so every step replays bucket 8 with
three padded rows, and the sequences finish their prompts at different steps (steps mixing
prefill and decode run eagerly, between replays). The stats must show graphs replayed: a capture
that failed falls back to eager with a warning and would otherwise pass unseen. The tokens are
compared with the eager engine's on the same device, and with HF's where the installed
transformers is an oracle for the checkpoint (`tiny_models.require_hf_swiglu_config`)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompt_ids

from splitmoe import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

MAX_TOKENS = 12
PROMPTS = [prompt_ids(n, seed=i) for i, n in enumerate((1, 6, 23, 9, 3))]

# MHA with a dense first layer's MLP, MLA, sliding-window layers with sinks; colocated and with
# the experts on a rank of their own (two ranks sharing the GPU), with one micro-batch or two
# (attention segments then run eagerly, the experts' graphs still replay)
CASES = [
    ("qwen3_moe_dense", 0, 1),
    ("qwen3_moe", 1, 1),
    ("qwen3_moe", 1, 2),
    ("deepseek_v3", 0, 1),
    ("gpt_oss", 1, 1),
]


def _generate(ckpt, expert_ranks: int, m: int, eager: bool) -> tuple[list[list[int]], list]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(
        str(ckpt),
        expert_ranks=expert_ranks,
        micro_batches=m,
        dtype="float32",
        device="cuda",
        max_num_seqs=8,
        enforce_eager=eager,
        timeout_s=600,
    ) as llm:
        outs = llm.generate(PROMPTS, params)
        return [list(o.token_ids) for o in outs], llm.stats()


@pytest.mark.parametrize(
    "ckpt_name,expert_ranks,m", CASES, ids=[f"{n}-1+{e}-m{m}" for n, e, m in CASES]
)
def test_graphed_decode_matches_eager_and_hf(ckpt_name, expert_ranks, m, tiny_ckpt, hf_ref):
    ckpt = tiny_ckpt(ckpt_name)
    got, stats = _generate(ckpt, expert_ranks, m, eager=False)
    attn = stats[0]
    assert attn["compile_errors"] == {}
    assert attn["cuda_graph_sizes"] == [1, 2, 4, 8]
    if m == 1:
        assert attn["cuda_graph_steps"] >= MAX_TOKENS - 2, "decode steps ran eagerly"
    # the experts' graphs, on the expert rank (up to 8 rows from its one attention rank) or
    # colocated: a call per MoE layer and micro-batch of every step of up to 8 rows
    experts = attn["expert_cuda_graph_steps"] if expert_ranks == 0 else stats[1]["cuda_graph_steps"]
    if expert_ranks:
        assert stats[1]["cuda_graph_sizes"] == [1, 2, 4, 8]
    assert experts >= MAX_TOKENS - 2, "the experts ran eagerly"
    eager, eager_stats = _generate(ckpt, expert_ranks, m, eager=True)
    assert eager_stats[0]["cuda_graph_steps"] == 0
    assert all(s.get("cuda_graph_steps", 0) == 0 for s in eager_stats)
    assert got == eager  # the same device and kernels, eager: whatever transformers' version
    try:
        expected = [hf_ref(ckpt, p, MAX_TOKENS) for p in PROMPTS]
    except pytest.skip.Exception:  # (an HF that is no oracle for this checkpoint: above)
        return
    for i, (want, out) in enumerate(zip(expected, got)):
        assert out == want, f"prompt {i} (len {len(PROMPTS[i])})"
