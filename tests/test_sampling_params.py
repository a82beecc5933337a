"""`SamplingParams` refuses every value the ranks cannot honour, with a ValueError naming the
field, and what it accepts is normalised, hashable, picklable and rebuilt by `from_dict`."""

from __future__ import annotations

import math
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitmoe import SamplingParams
from splitmoe.sampling_params import MAX_SEED

ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.lists(st.integers(-3, 300), max_size=3),
    st.dictionaries(st.one_of(st.integers(-3, 300), st.text(max_size=3)), st.floats(), max_size=3),
)
FIELDS = [
    "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "stop_token_ids",
    "ignore_eos", "stop", "logprobs",
]  # fmt: skip


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), ANY, max_size=4))
def test_any_values_are_refused_by_name_or_accepted_in_range(kw):
    try:
        p = SamplingParams(**kw)
    except ValueError as e:
        assert any(name in str(e) for name in kw), f"{kw}: {e}"
        return
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        v = getattr(p, name)
        assert isinstance(v, float) and math.isfinite(v)
    assert p.temperature == 0 or p.temperature >= 0.01
    assert 0 < p.top_p <= 1 and 0 <= p.min_p <= 1 and p.repetition_penalty > 0
    assert -2 <= p.presence_penalty <= 2 and -2 <= p.frequency_penalty <= 2
    assert p.seed is None or (type(p.seed) is int and 0 <= p.seed <= MAX_SEED)
    assert type(p.max_tokens) is int and 0 <= p.min_tokens <= p.max_tokens
    assert all(type(t) is int and t >= 0 and -100 <= b <= 100 for t, b in p.logit_bias)
    assert type(p.ignore_eos) is bool
    assert pickle.loads(pickle.dumps(p)) == p and hash(p) == hash(
        SamplingParams.from_dict(p.__dict__)
    )
    assert SamplingParams.from_dict(dict(p.__dict__)) == p


@pytest.mark.parametrize(
    "kw,want",
    [
        (dict(temperature=1e-40), dict(temperature=0.01)),
        (dict(temperature=0.005), dict(temperature=0.01)),
        (dict(temperature=0), dict(temperature=0.0)),
        (dict(seed=MAX_SEED), dict(seed=MAX_SEED)),
        (dict(logit_bias={"7": 250, 3: -1e9}), dict(logit_bias=((3, -100.0), (7, 100.0)))),
        (dict(logit_bias=[[5, 1.5]]), dict(logit_bias=((5, 1.5),))),
        (dict(stop_token_ids=[4, 2], stop="x"), dict(stop_token_ids=(4, 2), stop=("x",))),
    ],
)
def test_values_are_normalised(kw, want):
    p = SamplingParams(**kw)
    for name, value in want.items():
        assert getattr(p, name) == value


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(seed=2**64), r"seed=18446744073709551616 .*\[0, 2\*\*64 - 1\]"),
        (dict(seed=10**5000), r"seed=<an integer of \d+ bits>"),
        (dict(temperature=-1), r"temperature=-1.0 must be finite and >= 0"),
        (dict(temperature=math.nan), r"temperature=nan must be a finite number"),
        (dict(top_k=True), "top_k=True"),
        (dict(max_tokens=4, min_tokens=5), r"min_tokens=5 .*\[0, max_tokens=4\]"),
        (dict(logit_bias={1: 1, "1": 2}), "logit_bias names token id 1 twice"),
        (dict(logit_bias={"-1": 1}), "logit_bias key '-1' must be a token id"),
        (dict(ignore_eos=1), "ignore_eos=1 must be True or False"),
    ],
)
def test_refusals_name_the_field_and_range(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_check_vocab_covers_logit_bias():
    SamplingParams(logit_bias={99: 1}).check_vocab(100)
    with pytest.raises(ValueError, match=r"logit_bias token ids \[100\] .*\[0, 100\)"):
        SamplingParams(logit_bias={100: 1}).check_vocab(100)


def test_from_dict_rejects_unknown_fields_and_reads_json_shapes():
    p = SamplingParams.from_dict({"logit_bias": {"5": -3}, "stop_token_ids": [1], "min_p": 0.1})
    assert p.logit_bias == ((5, -3.0),) and p.stop_token_ids == (1,) and p.adjusts_logits
    with pytest.raises(ValueError, match="unknown sampling field"):
        SamplingParams.from_dict({"temprature": 1.0})
