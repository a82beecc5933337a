"""The next step's inputs that a sampled micro-batch begins (`AttentionWorker._begin`): derived
from its inputs, they are what `_decode_inputs` packs for the requests that go on, and each
request gets the KV block its next token starts."""

from __future__ import annotations

import time

import numpy as np
import torch
from tiny_models import prompt_ids

from splitmoe import SamplingParams
from splitmoe.attention_nodes.worker import AttentionWorker
from splitmoe.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from splitmoe.scheduler.request import RequestSpec


def test_begun_inputs_are_the_packed_inputs_of_the_requests_that_go_on(tiny_ckpt):
    cfg = EngineConfig(
        model=ModelConfig.from_hf(tiny_ckpt("qwen3_moe")),
        parallel=ParallelConfig(1, 0),
        cache=CacheConfig(block_size=4, num_kv_blocks=64),
        device="cpu",
        dtype="float32",
    )
    worker = AttentionWorker(cfg, None, torch.device("cpu"))
    # prompts ending at every offset in a block; requests stop after 3 to 11 tokens
    for i, (n, stop) in enumerate(zip((1, 2, 3, 4, 5, 7, 8), (11, 3, 6, 9, 4, 11, 7))):
        params = SamplingParams(max_tokens=stop, temperature=0, ignore_eos=True)
        worker.add_request(RequestSpec(i, prompt_ids(n, seed=i), params, time.time()))
    worker.plan()  # (the prompts: their blocks)
    reqs = list(worker.scheduler.running)
    for req in reqs:  # as if the prompt were computed
        req.num_computed_tokens = req.num_tokens - 1
    rng = np.random.default_rng(0)
    inputs, _, _ = worker._decode_inputs(reqs)
    steps = 0
    while reqs:
        tokens = rng.integers(1, 100, len(reqs)).tolist()
        going, begun = worker._begin(reqs, inputs, tokens)  # (before the tokens are appended)
        for req, tok in zip(reqs, tokens):  # what sampling the micro-batch does next
            req.num_computed_tokens += 1
            req.append_token(tok, time.time())
            if req.finish_reason is not None:
                worker.scheduler.finish(req)
        assert going == [r for r in reqs if r.finish_reason is None]
        packed, _, _ = worker._decode_inputs(going)
        assert begun.token_ids.tolist() == packed.token_ids.tolist()
        assert begun.positions.tolist() == packed.positions.tolist()
        for row, req in enumerate(going):  # (its width may be larger: zeros past each table)
            assert len(req.block_table) == worker.blocks.blocks_for(req.num_tokens)
            assert begun.block_tables[row, : len(req.block_table)].tolist() == req.block_table
            assert not begun.block_tables[row, len(req.block_table) :].any()
        reqs, inputs = going, begun
        steps += 1
    assert steps == 11
    assert worker.blocks.num_used == 0  # (every finished request gave its blocks back)
