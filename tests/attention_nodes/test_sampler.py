"""Sampling filters and per-request random streams (unit level)."""

from __future__ import annotations

import torch

from splitmoe.attention_nodes.sampler import make_generator, sample
from splitmoe.sampling_params import SamplingParams

CPU = torch.device("cpu")


def _draws(params, logits, request_id=0, engine_seed=0, n=200):
    g = make_generator(params, request_id, engine_seed, CPU)
    return [sample(logits[None], [params], [g])[0] for _ in range(n)]


def test_greedy_needs_no_generator_and_takes_argmax():
    p = SamplingParams(temperature=0)
    assert make_generator(p, 0, 0, CPU) is None
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, 0.0, 0.0]])
    assert sample(logits, [p, p], [None, None]) == [1, 0]


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([2.0, 1.9, 1.8, -5.0, 1.7])
    assert set(_draws(SamplingParams(top_k=2, seed=1), logits)) <= {0, 1}
    # probabilities ~ [.28, .25, .23, .00, .21]: top_p 0.5 keeps the first two (0.28 < 0.5)
    assert set(_draws(SamplingParams(top_p=0.5, seed=1), logits)) == {0, 1}
    assert set(_draws(SamplingParams(top_p=1e-6, seed=1), logits)) == {0}


def test_streams_are_per_request_and_reproducible():
    logits = torch.zeros(50)
    seeded = SamplingParams(seed=5)
    assert _draws(seeded, logits, request_id=1) == _draws(seeded, logits, request_id=9)
    unseeded = SamplingParams()
    a = _draws(unseeded, logits, request_id=3, engine_seed=0)
    assert a == _draws(unseeded, logits, request_id=3, engine_seed=0)
    assert a != _draws(unseeded, logits, request_id=4, engine_seed=0)
    assert a != _draws(unseeded, logits, request_id=3, engine_seed=1)
