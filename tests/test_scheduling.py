"""Continuous batching end to end: chunked prefill, preemption, data-parallel routing, streaming
and metrics, all token-exact against HF transformers (float32)."""

from __future__ import annotations

import time

import pytest
import torch
from tiny_models import cpu_llm, prompt_ids

from splitmoe import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_long_prompt_is_chunked_while_others_keep_decoding(tiny_ckpt, hf_ref):
    ckpt = tiny_ckpt("qwen3_moe")
    short = [prompt_ids(3, seed=50), prompt_ids(4, seed=51)]
    long = prompt_ids(60, seed=52)
    with cpu_llm(ckpt, 1, 1, max_num_batched_tokens=8) as llm:
        llm.reset_metrics()
        # (long enough to outlast the prefill even when the ranks run far ahead of this
        # process's polls: at 40 tokens, a slow first poll let them finish during it)
        rids = llm.submit(short, SamplingParams(max_tokens=200, **GREEDY))
        produced = 0
        while produced < 4:  # both short requests are decoding
            produced += len(llm.poll())
        n_before = len(llm.step_records)
        [long_id] = llm.submit([long], SamplingParams(max_tokens=5, **GREEDY))
        outs = {}
        while len(outs) < 3:
            for out, _ in llm.poll():
                if out.finished:
                    outs[out.request_id] = out
        steps = llm.step_records[n_before:]
    # while the 60-token prompt was prefilled (in chunks of at most 8 - 2 = 6 tokens), every
    # step still carried both decodes
    long_out = outs[long_id]
    first_token_at = long_out.metrics.arrival_time + long_out.metrics.ttft
    prefill_steps = [s for s in steps if s.time < first_token_at - 1e-6]
    assert len(prefill_steps) >= 60 // 6
    assert all(s.num_tokens <= 8 for s in steps)
    assert all(s.num_decode == 2 for s in prefill_steps[1:])
    for rid, p, n in [(rids[0], short[0], 200), (rids[1], short[1], 200), (long_id, long, 5)]:
        assert outs[rid].token_ids == hf_ref(ckpt, p, n)


def test_small_pool_preempts_and_every_request_completes_exactly(tiny_ckpt, hf_ref):
    ckpt = tiny_ckpt("qwen2_moe")
    prompts = [prompt_ids(n, seed=60 + n) for n in (5, 9, 13, 7, 3, 11)]
    # 10 blocks x 4 tokens = 40 slots; the six requests need ~100 together, 24 at most alone
    with cpu_llm(ckpt, 1, 2, block_size=4, num_kv_blocks=10) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
        m = llm.metrics()
    assert m.num_preemptions > 0 and m.kv_usage_max == 1.0
    assert m.num_requests == len(prompts) and m.output_tokens == 12 * len(prompts)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_ref(ckpt, p, 12)


def test_requests_spread_over_attention_ranks(tiny_ckpt, hf_ref):
    ckpt = tiny_ckpt("mixtral")
    prompts = [prompt_ids(n, seed=70 + i) for i, n in enumerate((30, 2, 3, 2, 28, 4, 3, 2))]
    with cpu_llm(ckpt, 2, 1) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY))
        steps = llm.step_records
        # every token a request added to its rank's load went back when it finished: the next
        # requests are routed as on an idle engine
        assert llm.engine.router.load == [0, 0]
    ranks = [o.attention_rank for o in outs]
    assert set(ranks) == {0, 1}
    # least-load routing: the two long prompts go to different ranks
    assert ranks[0] != ranks[4]
    assert {s.rank for s in steps} == {0, 1}
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_ref(ckpt, p, 6)


def test_request_that_can_never_fit_is_rejected_up_front(tiny_ckpt):
    ckpt = tiny_ckpt("qwen3_moe")
    with cpu_llm(ckpt, 1, 0, block_size=4, num_kv_blocks=4) as llm:
        with pytest.raises(ValueError, match="more than the whole KV pool of 4 blocks x 4"):
            llm.generate([prompt_ids(10, seed=1)], SamplingParams(max_tokens=10))
        ok = llm.generate([prompt_ids(10, seed=1)], SamplingParams(max_tokens=7, **GREEDY))
        assert len(ok[0].token_ids) == 7


def test_stream_and_metrics_are_consistent(tiny_ckpt):
    ckpt = tiny_ckpt("olmoe")
    prompts = ["hello world", "abc"]
    with cpu_llm(ckpt, 1, 1) as llm:
        t0 = time.time()
        tokens = {0: [], 1: []}
        texts = {0: "", 1: ""}
        finals = {}
        for d in llm.stream(prompts, SamplingParams(max_tokens=9, **GREEDY)):
            tokens[d.index] += d.token_ids
            texts[d.index] += d.text
            if d.output is not None:
                finals[d.index] = d.output
        wall = time.time() - t0
        outs = llm.generate(prompts, SamplingParams(max_tokens=9, **GREEDY))
        agg = llm.metrics()
    for i in (0, 1):
        assert tokens[i] == finals[i].token_ids == outs[i].token_ids
        assert texts[i] == finals[i].text
        m = finals[i].metrics
        assert len(m.tbt) == 8 and m.num_output_tokens == 9
        assert 0 <= m.queue_time <= m.ttft <= m.e2e_latency <= wall
        assert m.e2e_latency == pytest.approx(m.ttft + sum(m.tbt), abs=1e-6)
        assert m.tpot == pytest.approx(sum(m.tbt) / 8, abs=1e-9)
    assert agg.num_requests == 2 and agg.output_tokens == 18
    assert agg.ttft_p50 <= agg.ttft_p99 and agg.tbt_p50 <= agg.tbt_p99
    assert agg.input_tokens == sum(len(o.prompt_token_ids) for o in outs)
    assert agg.seqs_per_step_max == 2 and agg.num_steps >= 9


def test_a_late_poll_reports_each_request_once_with_all_its_steps(tiny_ckpt):
    """The ranks ran many steps before the front end looked: one `poll` takes them all in,
    and still names each request once (finished once), its new tokens those steps' in order."""
    ckpt = tiny_ckpt("olmoe")
    with cpu_llm(ckpt, 1, 0) as llm:
        want = llm.generate(["hello world", "abc"], SamplingParams(max_tokens=12, **GREEDY))
        rids = llm.submit(["hello world", "abc"], SamplingParams(max_tokens=12, **GREEDY))
        time.sleep(3)  # (every step done, waiting to be read)
        seen, finished = {rid: [] for rid in rids}, []
        deadline = time.monotonic() + 30
        while len(finished) < len(rids):
            assert time.monotonic() < deadline
            got = llm.poll(timeout=1)
            assert len({out.request_id for out, _ in got}) == len(got)
            for out, new in got:
                seen[out.request_id] += new
                if out.finished:
                    finished.append(out)
    assert sorted(o.request_id for o in finished) == sorted(rids)
    for out, w in zip(sorted(finished, key=lambda o: o.request_id), want):
        assert seen[out.request_id] == out.token_ids == w.token_ids


def test_stream_text_deltas_add_up_without_decoding_everything(tiny_ckpt):
    """The incremental detokenizer's deltas join to the full decode at every step (also across
    tokens that split a character), decoding a window instead of the whole output."""
    from splitmoe.engine.output import Detokenizer
    from splitmoe.outputs import RequestOutput
    from splitmoe.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(tiny_ckpt("olmoe"))
    ids = torch.randint(0, 200, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    decoded = []

    class Counting:
        def decode(self, window):
            decoded.append(len(window))
            return tok.decode(window)

    d = Detokenizer(Counting())
    out = RequestOutput(request_id=0, prompt_token_ids=[1])
    text = ""
    for i, t in enumerate(ids):
        out.token_ids.append(t)
        text += d.delta(out)
        full = tok.decode(out.token_ids)
        assert full.startswith(text) and len(full) - len(text) <= 8 * (i + 1 - d.read)
    out.finish_reason, out.text = "length", tok.decode(ids)
    text += d.delta(out)
    assert text == out.text
    assert max(decoded) < 40  # windows, not the whole 300-token output
