"""`LLM.warm_up`: made-up requests at every batch size and prompt chunk before serving, which
leave the engine as they found it; the server runs it before /health answers."""

from __future__ import annotations

from tiny_models import cpu_llm, prompt_ids

from splitmoe import SamplingParams


def test_warm_up_covers_the_batch_sizes_and_leaves_the_engine_clean(tiny_ckpt, hf_ref):
    ckpt = tiny_ckpt("qwen3_moe")
    prompts = [prompt_ids(7, seed=i) for i in range(3)]
    with cpu_llm(
        ckpt, 1, 1, max_num_seqs=5, max_num_batched_tokens=96, num_kv_blocks=96, block_size=4
    ) as llm:
        ran = llm.warm_up(decode_steps=3, prefill_repeats=2)
        # powers of two up to max_num_seqs, and three quarters of each
        assert ran["decode_batches"] == [1, 2, 3, 4]
        assert ran["prefill_tokens"] == [32, 64]  # from 32 up to the step's token budget
        assert ran["seconds"] > 0
        assert llm.metrics().num_requests == 0  # (its requests are not the caller's)
        attention, expert = llm.stats()
        assert attention["running"] == 0 and attention["waiting"] == 0
        assert attention["kv_blocks_used"] == 0  # (its prompts stay cached, evictable)
        assert expert["tokens_served"] > 0  # (its requests went through the expert rank)
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_ref(ckpt, p, 6)


def test_warm_up_fits_a_short_max_model_len(tiny_ckpt):
    ckpt = tiny_ckpt("qwen3_moe")
    with cpu_llm(ckpt, 1, 0, max_num_seqs=2, max_model_len=20, block_size=4) as llm:
        ran = llm.warm_up(decode_steps=16)
        assert ran["prefill_tokens"] == []  # (no prompt of 32 tokens fits)
        assert llm.stats()[0]["running"] == 0
