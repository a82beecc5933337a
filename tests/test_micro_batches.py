"""Ping-pong micro-batches: the same tokens as HF transformers for any micro-batch count."""

from __future__ import annotations

import random

import pytest
from tiny_models import prompt_ids

from splitmoe import LLM, SamplingParams
from splitmoe.attention_nodes.micro_batch import split_micro_batches
from splitmoe.config import ParallelConfig

PROMPTS = [prompt_ids(n, seed=80 + i) for i, n in enumerate((1, 7, 19, 4, 11, 2))]


def test_split_balances_tokens_and_keeps_batch_order():
    assert split_micro_batches([5, 1, 1, 1, 4], 2) == [[0, 2], [1, 3, 4]]  # 6 and 6 tokens
    assert split_micro_batches([3], 3) == [[0], [], []]
    assert split_micro_batches([], 2) == [[], []]
    assert split_micro_batches([1] * 7, 3) == [[0, 3, 6], [1, 4], [2, 5]]  # decode: round robin


def _split_by_definition(num_tokens, m):
    """Longest request first onto the lightest micro-batch, ties to the lowest index."""
    loads, parts = [0] * m, [[] for _ in range(m)]
    for i in sorted(range(len(num_tokens)), key=lambda i: (-num_tokens[i], i)):
        j = min(range(m), key=lambda j: (loads[j], j))
        loads[j] += num_tokens[i]
        parts[j].append(i)
    return [sorted(p) for p in parts]


def test_split_follows_its_definition():
    rng = random.Random(0)
    for _ in range(300):
        n, m = rng.randrange(0, 40), rng.randrange(1, 5)
        tokens = [rng.choice((1, 1, 1, 2, 5, 16, 16, 40)) for _ in range(n)]
        if rng.random() < 0.3:
            tokens = [rng.choice((1, 3))] * n
        assert split_micro_batches(tokens, m) == _split_by_definition(tokens, m), (tokens, m)


def test_configuration_fixes_the_count_or_leaves_it_to_measurements():
    p = ParallelConfig(attention_ranks=2, expert_ranks=1)
    assert p.micro_batches == "auto"
    assert p.micro_batches_for((1, 0)) == 1  # one token: nothing to split
    assert p.micro_batches_for((0, 40)) is None  # chosen from measured times
    assert ParallelConfig(2, 1, micro_batches=None).micro_batches_for((0, 40)) is None
    assert ParallelConfig(1, 0).micro_batches_for((100,)) == 1  # colocated: nothing to overlap
    assert ParallelConfig(1, 1, micro_batches=3).micro_batches_for((1,)) == 3
    # ranks sharing one GPU take turns on it: nothing to overlap, unless asked for
    assert p.micro_batches_for((0, 40), shared_gpu=True) == 1
    assert ParallelConfig(1, 1, micro_batches=2).micro_batches_for((40,), shared_gpu=True) == 2
    for bad in (0, 17, "two", True, 2.0):
        with pytest.raises(ValueError, match="micro_batches="):
            ParallelConfig(1, 1, micro_batches=bad)


@pytest.mark.parametrize("attention_ranks,expert_ranks", [(1, 1), (2, 2)])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_tokens_match_hf(tiny_ckpt, hf_ref, attention_ranks, expert_ranks, m):
    ckpt = tiny_ckpt("qwen2_moe")  # shared expert: overlapped with the routed experts
    with LLM(
        str(ckpt),
        attention_ranks=attention_ranks,
        expert_ranks=expert_ranks,
        micro_batches=m,
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=16,
    ) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_ref(ckpt, p, 10)


def test_two_phase_with_micro_batches(tiny_ckpt, hf_ref):
    ckpt = tiny_ckpt("qwen3_moe")
    with LLM(
        str(ckpt),
        attention_ranks=2,
        expert_ranks=2,
        micro_batches=2,
        ranks_per_node=2,
        transport="two_phase",
        dtype="float32",
        device="cpu",
    ) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_ref(ckpt, p, 8)
