"""Prefix caching end to end (`LLM`, tiny Qwen3-MoE, float32): under KV pressure, with many
distinct prefixes that share blocks, every request finishes with HF's exact tokens; a repeated
prefix is served from the cache (``cached_tokens``, hit rate in `metrics`); aborted requests
free their blocks; stop strings and logprobs on the same path."""

from __future__ import annotations

import time

from tiny_models import cpu_llm, prompt_ids

from splitmoe import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_kv_pressure_many_prefixes_match_hf(tiny_ckpt, hf_ref):
    ckpt = tiny_ckpt("qwen3_moe")
    prefixes = [prompt_ids(40, seed=50 + i) for i in range(4)]
    prompts = [
        p + prompt_ids(3 + j, seed=70 + 4 * i + j) for i, p in enumerate(prefixes) for j in range(3)
    ]
    # 12 requests of ~56 tokens (4 blocks each) on 20 blocks: preemptions and evictions
    with cpu_llm(ckpt, 1, 0, num_kv_blocks=20, block_size=16, max_num_seqs=8) as llm:
        first = llm.generate(prompts, GREEDY)
        hits_first = llm.metrics().cached_tokens
        again = llm.generate(prompts[::-1], GREEDY)
        m = llm.metrics()
        stats = llm.stats()[0]
        # an aborted request frees its blocks at once
        [rid] = llm.submit([prompts[0]], SamplingParams(max_tokens=150, ignore_eos=True))
        while not llm.poll(timeout=5):
            pass
        llm.abort([rid])
        deadline = time.monotonic() + 10
        done = []
        while not done and time.monotonic() < deadline:
            done = [o for o, _ in llm.poll(timeout=1) if o.finished]
        assert done and done[0].finish_reason == "abort"
        assert llm.stats()[0]["kv_blocks_used"] == 0
    assert stats["preemptions"] > 0 and stats["prefix_evictions"] > 0, stats
    for p, out in zip(prompts, first):
        assert out.token_ids == hf_ref(ckpt, p, 12)
    for p, out in zip(prompts[::-1], again):
        assert out.token_ids == hf_ref(ckpt, p, 12)
    assert hits_first > 0  # (requests of one prefix found each other's blocks)
    assert m.cached_tokens > 0 and 0 < m.prefix_cache_hit_rate < 1
    assert sum(o.metrics.num_cached_tokens for o in again) == m.cached_tokens


def test_caching_off_gives_the_same_and_stop_strings_and_logprobs(tiny_ckpt):
    ckpt = tiny_ckpt("qwen3_moe")
    prompts = [prompt_ids(33, seed=90)] * 2 + [prompt_ids(33, seed=90)[:20] + [7, 8]]
    with cpu_llm(ckpt, 1, 0, enable_prefix_caching=False) as llm:
        off = [llm.generate([p], GREEDY)[0] for p in prompts]
        assert all(o.metrics.num_cached_tokens == 0 for o in off)
    with cpu_llm(ckpt, 1, 0) as llm:
        on = [llm.generate([p], GREEDY)[0] for p in prompts]
        assert [o.metrics.num_cached_tokens for o in on] == [0, 32, 16]
        text = on[0].text
        stop = text[5:7]
        cut = llm.generate(
            [prompts[0]],
            SamplingParams(
                max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop,), logprobs=2
            ),
        )[0]
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert cut.text == text[: text.find(stop)] and cut.finish_reason == "stop"
    assert cut.token_ids == on[0].token_ids[: len(cut.token_ids)]
    assert len(cut.logprobs) == len(cut.token_ids)
    for tok, (lp, top) in zip(cut.token_ids, cut.logprobs):
        assert top[0][0] == tok and top[0][1] == lp and len(top) == 2  # greedy: the top one


def test_cache_salt_keeps_tenants_apart(tiny_ckpt):
    ckpt = tiny_ckpt("qwen3_moe")
    prompt = prompt_ids(33, seed=91)  # 2 full blocks of 16 (the last one always recomputed)

    def run(llm, salt):
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, cache_salt=salt)
        return llm.generate([prompt], sp)[0]

    with cpu_llm(ckpt, 1, 0) as llm:
        outs = [run(llm, salt) for salt in ("a", "a", "b", None, None, "b")]
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 32, 0, 0, 32, 32]
    assert all(o.token_ids == outs[0].token_ids for o in outs)
