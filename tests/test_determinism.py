"""A seeded request gives the same tokens whatever the topology, its batch-mates and the
micro-batch count (per-request random streams)."""

from __future__ import annotations

from tiny_models import prompt_ids

from splitmoe import LLM, SamplingParams

PROMPTS = [prompt_ids(n, seed=90 + i) for i, n in enumerate((3, 12, 1, 25))]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7 + i, ignore_eos=True)
    for i in range(len(PROMPTS))
]


def _run(ckpt, prompts, params, **kw):
    with LLM(str(ckpt), dtype="float32", device="cpu", **kw) as llm:
        return [o.token_ids for o in llm.generate(prompts, params)]


def test_seeded_tokens_independent_of_topology_batch_and_micro_batches(tiny_ckpt):
    ckpt = tiny_ckpt("qwen3_moe")
    ref = _run(ckpt, PROMPTS, PARAMS, attention_ranks=1, expert_ranks=0)
    assert _run(ckpt, PROMPTS, PARAMS, attention_ranks=1, expert_ranks=2, micro_batches=1) == ref
    assert _run(ckpt, PROMPTS, PARAMS, attention_ranks=2, expert_ranks=2, micro_batches=2) == ref
    # alone, and among other requests, split three ways
    alone = _run(ckpt, PROMPTS[1:2], PARAMS[1:2], attention_ranks=1, expert_ranks=1)
    assert alone == ref[1:2]
    crowd = [prompt_ids(n, seed=200 + n) for n in (4, 9, 30)]
    crowd_params = [SamplingParams(max_tokens=5, temperature=1.0)] * 3
    mixed = _run(
        ckpt,
        crowd + PROMPTS,
        crowd_params + PARAMS,
        attention_ranks=1,
        expert_ranks=1,
        micro_batches=3,
    )
    assert mixed[3:] == ref
