"""One bad request fails alone.

A request whose handling raises inside its attention rank (here: `FaultyParams`, which raise
when a rank reads one of their attributes) comes back with ``finish_reason="error"`` and an
error message, while the requests around it get exactly the tokens they get without it, and the
job keeps serving. Values that used to kill a rank are refused by `SamplingParams` or served.
"""

from __future__ import annotations

import math

import pytest
from fault_params import FaultyParams, armed_ranks
from small_default import write_small_model

from splitmoe import LLM, SamplingParams

PROMPTS = [[3 + i, 40 + 7 * i, 11, 200 - i, 5 * i + 1][: 2 + i % 4] for i in range(10)]


def _others() -> list[SamplingParams]:
    """Ten concurrent requests: greedy and seeded, some with logprobs or controls."""
    out = []
    for i in range(10):
        kw = dict(max_tokens=6 + i % 5, ignore_eos=True)
        if i % 2:
            kw.update(temperature=0.9, seed=1000 + i, top_k=50)
        else:
            kw.update(temperature=0.0)
        if i % 3 == 0:
            kw.update(logprobs=2)
        if i % 4 == 1:
            kw.update(repetition_penalty=1.3, logit_bias={7: 2.5})
        out.append(SamplingParams(**kw))
    return out


FAULTS = {
    "sampler": FaultyParams(max_tokens=8, temperature=0.7, seed=5, fault_on="top_p"),
    "greedy row": FaultyParams(max_tokens=8, temperature=0.0, fault_on="adjusts_logits"),
    "logprobs": FaultyParams(max_tokens=8, temperature=0.0, logprobs=1, fault_on="logprobs"),
    "generator": FaultyParams(max_tokens=8, temperature=0.7, seed=9, fault_on="seed"),
    "admission": FaultyParams(max_tokens=8, temperature=0.0, fault_on="ignore_eos"),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_small_model(tmp_path_factory.mktemp("small"))


@pytest.fixture(scope="module", params=[(1, 0), (1, 1)], ids=["1+0", "1+1"])
def llm(request, ckpt):
    a, e = request.param
    with armed_ranks():
        llm = LLM(
            str(ckpt), attention_ranks=a, expert_ranks=e, device="cpu", dtype="float32", seed=7
        )
    with llm:
        yield llm


@pytest.fixture(scope="module")
def baseline(llm):
    outs = llm.generate(PROMPTS, _others())
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    return [(o.token_ids, o.logprobs) for o in outs]


@pytest.mark.parametrize("where", list(FAULTS))
def test_a_faulty_request_fails_alone(llm, baseline, where):
    params = _others()
    at = 4
    outs = llm.generate(
        PROMPTS[:at] + [[9, 8, 7]] + PROMPTS[at:], [*params[:at], FAULTS[where], *params[at:]]
    )
    bad = outs.pop(at)
    assert bad.finish_reason == "error", bad
    assert "InjectedFault" in bad.error and bad.to_dict()["error"] == bad.error
    for i, (o, (tokens, logprobs)) in enumerate(zip(outs, baseline)):
        assert o.finish_reason == "length" and o.error is None
        assert o.token_ids == tokens, f"request {i} changed"
        if logprobs is not None:
            assert [t for t, _ in o.logprobs] == pytest.approx([t for t, _ in logprobs])
    # the job serves on, the failed request's KV blocks were freed
    again = llm.generate(PROMPTS, _others())
    assert [o.token_ids for o in again] == [t for t, _ in baseline]
    assert llm.stats()[0]["running"] == 0


def test_a_stream_with_a_faulty_request(llm, baseline):
    """Streamed, the faulty request's last delta says "error"; the others stream on."""
    params = _others()
    deltas = list(llm.stream(PROMPTS + [[9, 8, 7]], params + [FAULTS["sampler"]]))
    last = {d.index: d for d in deltas if d.finish_reason}
    assert last[len(PROMPTS)].finish_reason == "error"
    assert last[len(PROMPTS)].output.error
    for i, (tokens, _) in enumerate(baseline):
        assert last[i].output.token_ids == tokens


@pytest.mark.parametrize(
    "kw",
    [
        dict(seed=2**64 - 1, temperature=1.0),
        dict(temperature=1e-40),
        dict(temperature=1e-40, seed=3),
    ],
    ids=str,
)
def test_extreme_values_in_range_are_served(llm, kw):
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True, **kw))
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2, temperature=0))[0].token_ids


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(seed=2**64), "seed"),
        (dict(temperature=-1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(seed=True), "seed"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(min_tokens=17), "min_tokens"),
        (dict(logit_bias={"abc": 1}), "logit_bias"),
        (dict(logit_bias={1: math.nan}), "logit_bias"),
    ],
)
def test_out_of_range_values_are_refused(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)
