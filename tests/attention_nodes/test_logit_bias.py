"""``logit_bias`` in one tensor operation per step (`sampler.add_logit_bias`): the same logits
as the per-row way it replaced (a Python list of ids and a tensor of biases built per row and
step: ~88 ms a row for a whole-vocabulary bias at 152k tokens), the request's index/value
tensors built once."""

from __future__ import annotations

import pickle

import torch

from splitmoe.attention_nodes.sampler import add_logit_bias, sample
from splitmoe.sampling_params import SamplingParams


def _per_row(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The replaced code, row by row."""
    out = logits.clone()
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = [t for t, _ in p.logit_bias]
            out[i, ids] += torch.tensor([b for _, b in p.logit_bias], device=out.device)
    return out


def test_one_operation_gives_the_per_row_logits():
    g = torch.Generator().manual_seed(0)
    V = 1000
    logits = torch.randn(9, V, generator=g) * 4  # [B, V]
    params = []
    for i in range(9):
        k = [0, 1, 7, 300, V, 0, 50, 2, 999][i]  # entries; 0: no bias on that row
        ids = torch.randperm(V, generator=g)[:k].tolist()
        biases = (torch.rand(k, generator=g) * 240 - 120).tolist()  # (some clamped to +-100)
        params.append(SamplingParams(temperature=0, logit_bias=dict(zip(ids, biases))))
    want = _per_row(logits, params)
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    got = add_logit_bias(logits, rows, [params[i] for i in rows])
    assert torch.equal(got, want[rows])
    assert torch.equal(logits, _per_row(logits, [SamplingParams()] * 9))  # (left as it was)
    # and what the sampler picks: the argmax of the biased rows, the others untouched
    tokens = sample(logits, params, [None] * 9, [_NoHistory()] * 9)
    assert tokens == want.argmax(-1).tolist()


def test_the_tensors_are_built_once_and_never_sent():
    p = SamplingParams(logit_bias={"5": 2.0, 3: -1.0})
    fresh = pickle.dumps(p)
    ids, biases = p.logit_bias_tensors
    assert ids.tolist() == [3, 5] and biases.tolist() == [-1.0, 2.0]
    assert p.logit_bias_tensors[0] is ids  # (kept on the params object)
    assert pickle.loads(fresh) == p and "logit_bias_tensors" not in pickle.loads(fresh).__dict__
    assert SamplingParams.from_dict(p.__dict__) == p  # (a derived attribute, not a field)


class _NoHistory:
    prompt_token_ids: list[int] = []
    output_token_ids: list[int] = []
