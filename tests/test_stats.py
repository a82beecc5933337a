"""`LLM.stats()`: a snapshot from every rank; `LLM.latest_stats()`: the counters the ranks
publish on their own."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
from tiny_models import prompt_ids

from splitmoe import LLM, SamplingParams
from splitmoe.runtime import available_cores, pin_cores


def test_stats_from_every_rank(tiny_ckpt):
    ckpt = tiny_ckpt("qwen3_moe")
    with LLM(
        str(ckpt), attention_ranks=2, expert_ranks=2, device="cpu", num_kv_blocks=64, block_size=4
    ) as llm:
        llm.generate([prompt_ids(9, seed=i) for i in range(6)], SamplingParams(max_tokens=5))
        stats = llm.stats()
    assert [s["rank"] for s in stats] == [0, 1, 2, 3]
    assert [s["role"] for s in stats] == ["attention"] * 2 + ["expert"] * 2
    for s in stats[:2]:
        # every request finished: all KV blocks are free again
        assert s["kv_blocks_used"] == 0 and s["kv_blocks_total"] == 64
        assert s["running"] == 0 and s["waiting"] == 0
    assert [s["experts"] for s in stats[2:]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(s["tokens_served"] > 0 for s in stats[2:])
    assert all(0 < s["rss_mb"] <= s["peak_rss_mb"] + 1 for s in stats)
    # "auto" on CPU is the PyTorch backend
    assert [s["attention_backend"] for s in stats[:2]] == ["torch"] * 2
    assert [s["moe_backend"] for s in stats] == [None, None, "torch", "torch"]
    # torch gets the node's cores shared by its 4 ranks
    cores = available_cores()
    n = max(1, len(cores) // 4)
    assert all(s["threads"] == n for s in stats)
    # each rank on cores of its own (as many as its threads) where the 4 ranks fit side by
    # side; else all share
    if len(cores) >= 4:
        assert [s["cores"] for s in stats] == [cores[i * n : (i + 1) * n] for i in range(4)]
    else:
        assert all(s["cores"] == cores for s in stats)


def _pin_in_child(args, out) -> None:
    out.put((pin_cores(*args), sorted(os.sched_getaffinity(0))))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity calls")
def test_pin_cores_fits_ranks_side_by_side_or_leaves_them():
    cores = available_cores()
    ctx = mp.get_context("fork")  # (a child: pinning the test process would slow the suite)

    def run(*args):
        out = ctx.Queue()
        p = ctx.Process(target=_pin_in_child, args=(args, out))
        p.start()
        got = out.get(timeout=30)
        p.join()
        return got

    n = len(cores)
    assert run(n - 1, n, 1) == ([cores[-1]], [cores[-1]])  # last of n one-thread ranks
    assert run(0, 1, n) == (cores, cores)  # one rank with every core
    assert run(0, n + 1, 1) == (None, cores)  # more ranks than cores: left to the OS
    assert run(0, 1, n + 1) == (None, cores)


def test_ranks_publish_their_counters_without_being_asked(tiny_ckpt):
    ckpt = tiny_ckpt("qwen3_moe")
    with LLM(
        str(ckpt), attention_ranks=1, expert_ranks=1, device="cpu", num_kv_blocks=64, block_size=4
    ) as llm:
        # start-up: each rank published once, unasked
        deadline = time.monotonic() + 10
        while len(llm.latest_stats()) < 2:
            assert time.monotonic() < deadline, llm.latest_stats()
            llm.poll(timeout=0.1)
        first = llm.latest_stats()
        assert [(s["rank"], s["role"]) for s in first] == [(0, "attention"), (1, "expert")]
        assert first[0]["kv_blocks_used"] == 0 and first[0]["kv_blocks_total"] == 64
        # a running request is published soon after it arrives, while it runs
        [rid] = llm.submit([prompt_ids(9, seed=1)], SamplingParams(max_tokens=400, ignore_eos=True))
        seen = None
        while seen is None:
            assert llm.poll(timeout=5), "no step"
            snap = llm.latest_stats()[0]
            if snap["published_at"] > first[0]["published_at"] and snap["running"] == 1:
                seen = snap
        assert seen["kv_blocks_used"] >= 3  # (9 prompt tokens in blocks of 4)
        llm.abort([rid])
        # the job going idle is published too, and the expert rank's count of tokens served
        # grew (each rank publishes on its own clock: the expert's may come after the idle one)
        deadline = time.monotonic() + 10
        while True:
            llm.poll(timeout=0.1)
            attn, expert = llm.latest_stats()
            idle = attn["kv_blocks_used"] == 0 and attn["running"] == 0
            if idle and expert["tokens_served"] > first[1]["tokens_served"]:
                break
            assert time.monotonic() < deadline, (attn, expert)
        # asked, the ranks still answer with every key (comm, balancer and the steps run with
        # each micro-batch count included)
        asked = llm.stats()
        for full, published in zip(asked, (attn, expert)):
            assert set(full) - set(published) == {"comm", "balancer", "micro_batch_steps"}
            assert set(published) - set(full) == {"published_at"}
