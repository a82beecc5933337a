"""Sampling filters, vLLM's logits controls and per-request random streams (unit level).

The controls are checked against `reference`, vLLM v1's semantics written out token by token
(logits processors min_tokens / logit_bias, then repetition / frequency / presence penalties,
then greedy argmax or temperature, min_p, top-k, top-p)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from splitmoe.attention_nodes.sampler import (
    adjust_logits,
    draw,
    make_generator,
    pick,
    sample,
    sampling_probs,
    temperature_probs,
)
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


# ----------------------------------------------------------------- vLLM's controls vs a reference

EOS = (2,)


@dataclass
class History:
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def reference(logits, p, hist, eos=EOS):
    """vLLM v1's semantics written out per token, in float64: the greedy token, or the
    distribution a sampled row is drawn from."""
    x = [float(v) for v in logits]
    vocab = len(x)
    out = list(hist.output_token_ids)
    if len(out) < p.min_tokens:  # min_tokens: the stop tokens (EOS too) cannot come yet
        for t in set(p.stop_token_ids) | set(eos):
            x[t] = -math.inf
    for t, b in p.logit_bias:
        x[t] += b
    for t in range(vocab):
        if p.repetition_penalty != 1.0 and (t in hist.prompt_token_ids or t in out):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * out.count(t)
        x[t] -= p.presence_penalty * (t in out)
    if p.greedy:
        return max(range(vocab), key=lambda t: (x[t], -t))

    def softmax(v):
        m = max(v)
        e = [math.exp(a - m) if a != -math.inf else 0.0 for a in v]
        return [a / sum(e) for a in e]

    x = [a / p.temperature for a in x]
    if p.min_p > 0:
        probs = softmax(x)
        x = [-math.inf if q < p.min_p * max(probs) else a for a, q in zip(x, probs)]
    if p.top_k > 0:
        kth = sorted(x, reverse=True)[min(p.top_k, vocab) - 1]
        x = [a if a >= kth else -math.inf for a in x]
    if p.top_p < 1.0:
        probs = softmax(x)
        order = sorted(range(vocab), key=lambda t: -x[t])
        before = 0.0
        for t in order:
            if before >= p.top_p:
                x[t] = -math.inf
            before += probs[t]
    return torch.tensor(softmax(x), dtype=torch.float64)


def _check_row(logits, p, hist, eos=EOS):
    want = reference(logits, p, hist, eos)
    if p.greedy:
        got = sample(logits[None], [p], [None], [hist], eos)[0]
        assert got == want, f"{p}: token {got}, reference {want}"
    else:
        row = adjust_logits(logits.clone(), p, hist, eos)
        got = sampling_probs(row, p).double()
        assert torch.allclose(got, want, atol=1e-5), f"{p}:\n{got}\n{want}"
        # the same tokens filtered out (underflow aside: float32 against float64)
        assert not got[want == 0].any() and (got[want > 1e-6] > 0).all(), f"{p}: support"


LOGITS = torch.tensor([1.5, -0.5, 3.0, 0.25, -2.0, 2.75, 0.0, 1.0, -1.0, 2.0])
HIST = History(prompt_token_ids=[0, 3, 3], output_token_ids=[5, 5, 1, 7])


@pytest.mark.parametrize(
    "kw",
    [
        dict(min_p=0.2),
        dict(repetition_penalty=1.8),
        dict(repetition_penalty=0.5),
        dict(presence_penalty=1.5),
        dict(frequency_penalty=-0.75),
        dict(frequency_penalty=2.0, presence_penalty=-1.0, repetition_penalty=1.3),
        dict(logit_bias={"4": 6.0, 2: -100.0}),
        dict(min_tokens=8, stop_token_ids=[5]),
        dict(min_tokens=4, stop_token_ids=[5]),  # reached: nothing masked
        dict(min_p=0.1, top_k=4, top_p=0.8, repetition_penalty=1.2, logit_bias={9: 1.0}),
    ],
    ids=str,
)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_controls_match_the_reference(kw, temperature):
    _check_row(LOGITS, SamplingParams(temperature=temperature, max_tokens=16, **kw), HIST)


def test_each_control_changes_the_outcome():
    """The fixed cases are not vacuous: every control moves the greedy token or the
    distribution away from the plain one."""
    plain = reference(LOGITS, SamplingParams(temperature=0.7), HIST)
    assert reference(LOGITS, SamplingParams(temperature=0), HIST) == 2
    for kw in (
        dict(min_p=0.2),
        dict(repetition_penalty=1.8),
        dict(presence_penalty=1.5),
        dict(frequency_penalty=-0.75),
        dict(logit_bias={4: 6.0}),
        dict(min_tokens=8, stop_token_ids=[5]),
    ):
        assert not torch.allclose(
            reference(LOGITS, SamplingParams(**kw, temperature=0.7), HIST), plain
        )
    assert reference(LOGITS, SamplingParams(temperature=0, logit_bias={4: 6.0}), HIST) == 4
    masked = SamplingParams(temperature=0, min_tokens=8, stop_token_ids=[2])  # 2: the top token
    assert sample(LOGITS[None], [masked], [None], [HIST], EOS) == [5]


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    data=st.data(),
    vocab=st.integers(2, 24),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    top_k=st.sampled_from([-1, 1, 3]),
    top_p=st.sampled_from([1.0, 0.6, 0.93]),
    rep=st.sampled_from([1.0, 0.6, 1.4]),
    pres=st.sampled_from([0.0, -1.2, 0.8]),
    freq=st.sampled_from([0.0, 0.35, -2.0]),
    min_tokens=st.integers(0, 4),
)
def test_random_controls_match_the_reference(
    data, vocab, temperature, min_p, top_k, top_p, rep, pres, freq, min_tokens
):
    token = st.integers(0, vocab - 1)
    logits = (
        torch.tensor(data.draw(st.lists(st.integers(-40, 40), min_size=vocab, max_size=vocab))) / 4
    )
    bias = data.draw(st.dictionaries(token, st.integers(-12, 12).map(lambda b: b / 2), max_size=3))
    hist = History(
        data.draw(st.lists(token, min_size=1, max_size=6)), data.draw(st.lists(token, max_size=6))
    )
    p = SamplingParams(
        max_tokens=8,
        temperature=temperature,
        min_p=min_p,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=rep,
        presence_penalty=pres,
        frequency_penalty=freq,
        logit_bias=bias,
        min_tokens=min_tokens,
        stop_token_ids=data.draw(st.lists(token, max_size=2)),
        seed=0,
    )
    eos = (vocab - 1,)
    assume(
        len(set(p.stop_token_ids) | set(eos)) < vocab or len(hist.output_token_ids) >= min_tokens
    )
    if p.greedy:  # (equal maxima after the penalties: the lowest id, in both)
        _check_row(logits, p, hist, eos)
    else:
        _check_row(logits, p, hist, eos)
        # and the draw comes from that support
        g = make_generator(p, 0, 0, CPU)
        tok = sample(logits[None], [p], [g], [hist], eos)[0]
        assert reference(logits, p, hist, eos)[tok] > 0


def test_sample_leaves_logits_alone_and_mixes_rows():
    """Plain greedy, adjusted greedy and sampled rows in one batch; the logits (which
    `token_logprobs` reads next) are not modified."""
    logits = torch.stack([LOGITS, LOGITS, LOGITS, LOGITS.flip(0)])
    before = logits.clone()
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logit_bias={4: 6.0}),
        SamplingParams(temperature=0.9, seed=3, repetition_penalty=1.5),
        SamplingParams(temperature=0, presence_penalty=2.0),
    ]
    gens = [make_generator(p, i, 0, CPU) for i, p in enumerate(params)]
    hist = [HIST] * 4
    tokens = sample(logits, params, gens, hist, EOS)
    assert torch.equal(logits, before)
    assert tokens[:2] == [2, 4]
    assert tokens[3] == reference(LOGITS.flip(0), params[3], HIST)
    alone = sample(logits[2:3], params[2:3], [make_generator(params[2], 2, 0, CPU)], hist[2:3], EOS)
    assert alone == tokens[2:3]


@pytest.mark.parametrize("big", [1e30, 3e38])
def test_huge_logits_at_the_lowest_temperature_give_no_nan(big):
    p = SamplingParams(temperature=1e-40, seed=1)  # (raised to 0.01)
    assert p.temperature == 0.01
    logits = torch.tensor([[big, -big, big / 2, 0.0]])
    row = sampling_probs(logits[0].clone(), p)
    assert torch.isfinite(row).all() and row[0] == 1.0
    assert sample(logits, [p], [make_generator(p, 0, 0, CPU)]) == [0]


def test_a_fully_masked_row_raises_instead_of_sampling_nan():
    p = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[0, 1], seed=1)
    logits = torch.tensor([[1.0, 2.0, -math.inf]])
    with pytest.raises(ValueError, match="cannot sample"):
        sample(logits, [p], [make_generator(p, 0, 0, CPU)], [History([0], [])], (2,))


@pytest.mark.parametrize("seed", [0, 2**63 - 1, 2**63, 2**64 - 1])
def test_every_seed_in_range_makes_a_generator(seed):
    p = SamplingParams(seed=seed)
    g = make_generator(p, 0, 0, CPU)
    assert sample(torch.zeros(1, 50), [p], [g])[0] in range(50)


_finite = st.floats  # (bounds given per field)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    t=st.one_of(st.just(0.0), _finite(0, 1e300)),
    top_p=st.one_of(st.just(1.0), _finite(1e-300, 1)),
    min_p=_finite(0, 1),
    top_k=st.one_of(st.just(-1), st.integers(1, 40)),
    rep=st.one_of(st.just(1.0), _finite(1e-300, 1e300)),
    pres=_finite(-2, 2),
    freq=_finite(-2, 2),
    bias=st.dictionaries(st.integers(0, 31), _finite(-1e300, 1e300), max_size=4),
    out=st.lists(st.integers(0, 31), max_size=6),
    min_tokens=st.integers(0, 3),
    seed=st.integers(0, 100),
)
def test_any_params_in_range_sample_a_token(
    t, top_p, min_p, top_k, rep, pres, freq, bias, out, min_tokens, seed
):
    """Whatever the fields hold within their ranges (extremes included: a top_p or penalty
    below float32's smallest value, a temperature past its largest), a row of ordinary logits
    gives a token of the vocabulary, never an exception (the fuzzer of the HTTP API found
    three such cases)."""
    logits = torch.randn(1, 32, generator=torch.Generator().manual_seed(seed)) * 3
    p = SamplingParams(
        max_tokens=4,
        temperature=t,
        top_p=top_p,
        min_p=min_p,
        top_k=top_k,
        repetition_penalty=rep,
        presence_penalty=pres,
        frequency_penalty=freq,
        logit_bias=bias,
        min_tokens=min_tokens,
    )
    g = torch.Generator().manual_seed(1)
    (token,) = sample(logits, [p], [g], [History([1, 2], out)], (0,))
    assert 0 <= token < 32
    if min_tokens > len(out):
        assert token != 0  # (EOS is masked until min_tokens)


def test_rows_with_only_a_temperature_take_the_batched_path_to_the_same_distribution():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=g) * 3
    temps = [0.3, 1.0, 1.7, 1e-30, 1e38]
    got = temperature_probs(logits, temps)
    for row, t, probs in zip(logits, temps, got):
        want = sampling_probs(row.clone(), SamplingParams(temperature=t))
        torch.testing.assert_close(probs, want)


def test_draws_follow_the_distribution_and_never_take_a_zero():
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.3], [0.0, 0.0, 1.0, 0.0]])
    gens = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    counts = torch.zeros(4)
    for _ in range(4000):
        a, b = draw(probs, gens)
        counts[a] += 1
        assert b == 2
    assert counts[1] == 0
    # within ~5 standard deviations of 4000 x p (sd <= sqrt(4000 x 0.25) ~ 32)
    assert ((counts - 4000 * probs[0]).abs() < 160).all(), counts


def test_a_batch_of_sampled_rows_draws_each_from_its_own_stream():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.8, seed=s) for s in range(6)]
    alone = [sample(logits[i : i + 1], [params[i]], [make_generator(params[i], i, 0, CPU)])[0]
             for i in range(6)]  # fmt: skip
    gens = [make_generator(p, i, 0, CPU) for i, p in enumerate(params)]
    assert sample(logits, params, gens) == alone


@pytest.mark.parametrize("V", [5, 1024, 3000])  # within one block, exactly one, a padded tail
def test_draws_land_on_the_token_whose_interval_holds_the_uniform(V):
    g = torch.Generator().manual_seed(V)
    probs = torch.rand(3, V, generator=g)
    probs[:, ::2] = 0  # (never drawn)
    probs /= probs.sum(-1, keepdim=True)
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    copies = [torch.Generator().manual_seed(s) for s in range(3)]
    for _ in range(20):
        got = draw(probs, gens)
        for r, t in enumerate(got):
            u = float(torch.rand(1, generator=copies[r], dtype=torch.float64))
            cdf = probs[r].double().cumsum(0)
            assert probs[r, t] > 0
            assert cdf[t] > u * cdf[-1] - 1e-9 and (t == 0 or cdf[t - 1] <= u * cdf[-1] + 1e-9)


def test_pick_takes_no_zero_at_the_ends_of_the_unit_interval():
    V = 2 * 1024 + 7  # (blocks of 1024, and a padded tail)
    probs = torch.zeros(4, V)
    probs[:, 5] = 0.25  # the first token with mass
    probs[:, 1500] = 0.5
    probs[:, 2050] = 0.25  # the last token with mass: zeros after it, in its block and beyond
    largest = 1 - 2.0**-53  # (torch.rand's largest float64)
    u = torch.tensor([0.0, 0.25, 0.75, largest], dtype=torch.float64)
    assert pick(probs, u).tolist() == [5, 1500, 2050, 2050]
    # float32 sums of many small masses: still within the row's tokens of mass
    probs = torch.rand(3, 5000) * (torch.arange(5000) % 3 == 0)
    got = pick(probs, torch.tensor([0.0, 0.5, largest], dtype=torch.float64))
    assert all(probs[r, t] > 0 for r, t in enumerate(got.tolist()))
