"""`Request`: the token bookkeeping the step loop reads for every request at every step."""

from __future__ import annotations

import pytest

from splitmoe.sampling_params import SamplingParams
from splitmoe.scheduler.request import Request, RequestSpec


def make(prompt, eos=(), max_model_len=1 << 30, **params) -> Request:
    spec = RequestSpec(7, list(prompt), SamplingParams(**params), 0.0)
    return Request(spec, eos_token_ids=tuple(eos), max_model_len=max_model_len)


def test_tokens_across_prompt_and_output():
    req = make([10, 11, 12], max_tokens=8)
    for t, now in ((20, 1.0), (21, 2.0)):
        req.append_token(t, now)
    every = [10, 11, 12, 20, 21]
    assert req.num_tokens == 5 and req.prompt_len == 3
    assert [req.token_at(i) for i in range(5)] == every
    for start in range(6):
        for end in range(start, 6):
            assert req.token_ids(start, end) == every[start:end], (start, end)


@pytest.mark.parametrize(
    "params, eos, max_model_len, tokens, reason",
    [
        (dict(max_tokens=3), (), 1 << 30, [5, 6, 7], "length"),
        (dict(max_tokens=9), (), 5, [5, 6], "length"),  # prompt 3 + 2 reaches the model limit
        (dict(max_tokens=9), (6,), 1 << 30, [5, 6], "stop"),
        (dict(max_tokens=9, ignore_eos=True), (6,), 1 << 30, [5, 6, 8], None),
        (dict(max_tokens=9, ignore_eos=True, stop_token_ids=(8,)), (6,), 1 << 30, [6, 8], "stop"),
        (dict(max_tokens=2, stop_token_ids=(6,)), (), 1 << 30, [5, 6], "stop"),  # stop wins
    ],
)
def test_finish_reason(params, eos, max_model_len, tokens, reason):
    req = make([1, 2, 3], eos=eos, max_model_len=max_model_len, **params)
    for i, t in enumerate(tokens):
        assert req.finish_reason is None
        ends = req.finishes_with(t)  # (what a begun step's micro-batch is built from)
        req.append_token(t, float(i))
        assert ends == (req.finish_reason is not None)
    assert req.finish_reason == reason
    assert req.token_times == [float(i) for i in range(len(tokens))]
