"""Next-token sampling with per-request random streams, in vLLM v1's order.

Per row of logits:

1. logits processors that can change the argmax: ``min_tokens`` (EOS and ``stop_token_ids``
   masked until that many tokens were generated), then ``logit_bias`` (every biased row of a
   step in one tensor operation, `add_logit_bias`);
2. penalties: repetition (prompt and output tokens), frequency and presence (output tokens);
3. greedy rows: argmax; sampled rows: temperature, ``min_p``, top-k, top-p, then a draw from
   the request's own generator.

Rows without any of these controls (all greedy, none adjusting logits: the common decode batch)
take one numpy argmax and nothing else; sampled rows whose only control is the temperature
(what an OpenAI client sends by default) take their probabilities in one batch
(`temperature_probs`), and every draw is one uniform number of the row's stream (`draw`).
Log-probabilities (`token_logprobs`) are those of the raw model distribution, as vLLM reports
them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from splitmoe.sampling_params import SamplingParams

_NEG_INF = float("-inf")
DRAW_BLOCK = 1024  # tokens per block of `draw`'s first level


class TokenHistory(Protocol):
    """What the sampler reads of a request beyond its params (`scheduler.request.Request` is
    one): the tokens the penalties and ``min_tokens`` look at."""

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...


def make_generator(
    params: SamplingParams, request_id: int, engine_seed: int, device: torch.device
) -> torch.Generator | None:
    """Every sampled request gets its own stream, so its tokens do not depend on the batch or the
    topology it runs in: from its ``seed``, or else from (engine seed, request id), which makes a
    whole `generate` call reproducible for a given `LLM(seed=...)`. Greedy requests need none.
    (``manual_seed`` takes any value in [0, 2**64 - 1], the range `SamplingParams` allows.)"""
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.manual_seed((engine_seed * 0x9E3779B97F4A7C15 + request_id * 0xBF58476D1CE4E5B9) % 2**63)
    return g


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    history: Sequence[TokenHistory] | None = None,
    eos_token_ids: Sequence[int] = (),
) -> list[int]:
    """``logits [B, V]`` float32 -> one token id per row.

    ``history[i]``: row i's prompt and output tokens, needed by rows whose params adjust logits
    (penalties, ``min_tokens``); ``eos_token_ids``: what ``min_tokens`` masks besides the
    request's ``stop_token_ids`` (EOS is masked even with ``ignore_eos``, as in vLLM).

    Generators are drawn from only once every row's logits were processed, so an exception
    leaves every stream as it was: the caller can retry row by row and only the faulty rows
    fail (`AttentionWorker._sample_logits`). ``logits`` itself is never modified.
    """
    if logits.shape[0] == 0:
        return []
    # greedy rows keep these (the first of equal maxima, as torch's argmax); on CPU numpy's
    # argmax, whose single-threaded loop costs a fraction of torch's at these sizes
    if logits.is_cpu:
        tokens = logits.numpy().argmax(-1).tolist()
    else:
        tokens = logits.argmax(dim=-1).tolist()
    if not any(p.temperature or p.adjusts_logits for p in params):
        return tokens
    draws: list[tuple[int, torch.Tensor]] = []  # (row, its probabilities [V])
    plain: list[int] = []  # sampled rows with no control but the temperature: one batch
    biased_rows = [i for i, p in enumerate(params) if p.logit_bias]
    biased = {}  # row -> its biased copy [V]
    if biased_rows:
        rows = add_logit_bias(logits, biased_rows, [params[i] for i in biased_rows])  # [R, V]
        biased = dict(zip(biased_rows, rows))
    for i, p in enumerate(params):
        if p.greedy and not p.adjusts_logits:
            continue
        if not p.greedy and not p.adjusts_logits and not p.filters:
            plain.append(i)
            continue
        row = biased[i] if i in biased else logits[i].to(torch.float32, copy=True)  # [V]
        if p.adjusts_logits:
            if history is None:
                raise ValueError("rows with penalties, logit_bias or min_tokens need history")
            row = _mask_and_penalize(row, p, history[i], eos_token_ids)
        if p.greedy:
            tokens[i] = int(row.argmax())
        else:
            draws.append((i, sampling_probs(row, p)))
    batches = []  # (rows, their probabilities [R, V]), all computed before any draw
    if draws:
        batches.append(([i for i, _ in draws], torch.stack([probs for _, probs in draws])))
    if plain:
        temps = [params[i].temperature for i in plain]
        batches.append((plain, temperature_probs(logits[plain].float(), temps)))
    for rows, probs in batches:
        for i, t in zip(rows, draw(probs, [generators[i] for i in rows])):
            tokens[i] = t
    return tokens


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> list[int]:
    """One token per row of ``probs [R, V]``, row r from ``generators[r]``: one uniform number
    each, through the row's cumulative distribution (`pick`). (``torch.multinomial`` draws V
    exponential numbers per row instead, which at a vocabulary of 150k tokens costs more than a
    decode step on a CPU; so would a float64 cumulative sum of every whole row, which `pick`'s
    two levels avoid.)"""
    u = torch.cat([torch.rand(1, generator=g, device=g.device, dtype=torch.float64)
                   for g in generators])  # fmt: skip
    return pick(probs, u.to(probs.device)).tolist()


def pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row of ``probs [R, V]`` whose share of the row's cumulative sum holds
    ``u [R]`` (float64 in [0, 1)), in two levels: the sums of blocks of `DRAW_BLOCK` tokens,
    accumulated in float64, pick the block; the block's own cumulative sum (float64) the token
    in it. A token of probability 0 is never picked, whatever the rounding."""
    R, V = probs.shape
    blocks = -(-V // DRAW_BLOCK)
    if V % DRAW_BLOCK:
        probs = F.pad(probs, (0, blocks * DRAW_BLOCK - V))
    p = probs.view(R, blocks, DRAW_BLOCK)
    sums = p.sum(-1).double()  # [R, blocks]
    upto = sums.cumsum(-1)  # [R, blocks]
    total = upto[:, -1:]  # [R, 1]
    target = torch.minimum(u.unsqueeze(1) * total, _below(total))  # (below the total)
    # upto[b - 1] <= target < upto[b]: block b has mass
    b = torch.searchsorted(upto, target, right=True).squeeze(1)  # [R]
    rows = torch.arange(R, device=probs.device)
    share = (target.squeeze(1) - (upto[rows, b] - sums[rows, b])) / sums[rows, b]
    local = p[rows, b].double().cumsum(-1)  # [R, DRAW_BLOCK]
    end = local[:, -1:]
    within = torch.minimum(share.clamp(min=0).unsqueeze(1) * end, _below(end))
    j = torch.searchsorted(local, within, right=True).squeeze(1)  # local[j] > within: p > 0
    return b * DRAW_BLOCK + j


def _below(x: torch.Tensor) -> torch.Tensor:
    """The largest floats below ``x`` (> 0): a target kept under them is under ``x`` whatever
    the rounding of the product that made it."""
    return torch.nextafter(x, torch.zeros_like(x))


def temperature_probs(logits: torch.Tensor, temperatures: Sequence[float]) -> torch.Tensor:
    """`sampling_probs` of rows ``logits [R, V]`` (float32) whose only control is their
    temperature, in one batch."""
    top = logits.amax(dim=-1, keepdim=True)  # [R, 1]
    if not torch.isfinite(top).all():
        bad = float(top[~torch.isfinite(top)][0])
        raise ValueError(
            f"cannot sample: a row's largest logit is {bad} (every token masked, or the model "
            "gave inf/nan)"
        )
    big = torch.finfo(logits.dtype).max  # (see `sampling_probs`)
    t = torch.tensor([min(x, big) for x in temperatures], device=logits.device).unsqueeze(1)
    return ((logits - top) / t).softmax(-1)


def add_logit_bias(
    logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams]
) -> torch.Tensor:
    """A float32 copy of ``logits[rows]`` (``logits [B, V]``) with ``params[j].logit_bias``
    added to row j, all rows in one ``index_add_`` over their precomputed
    ``logit_bias_tensors`` (built once per request: a whole-vocabulary bias built as a list
    per row and step is a Python loop over the vocabulary, tens of milliseconds a row).
    Returns ``[R, V]``; ``logits`` is left as it is."""
    out = logits[rows].to(torch.float32)  # [R, V] (a copy: indexing by a list gathers)
    V = out.shape[1]
    pairs = [p.logit_bias_tensors for p in params]
    ids = torch.cat([t for t, _ in pairs])  # [K] token ids, K = all rows' entries
    biases = torch.cat([b for _, b in pairs])  # [K]
    counts = torch.tensor([len(t) for t, _ in pairs])  # [R]
    starts = torch.arange(len(pairs), dtype=torch.int64).repeat_interleave(counts) * V  # [K]
    flat = (starts + ids).to(out.device)
    out.view(-1).index_add_(0, flat, biases.to(out.device))
    return out


def adjust_logits(
    row: torch.Tensor, p: SamplingParams, seq: TokenHistory, eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """Steps 1 and 2 on one row ``[V]`` (float32, modified in place and returned)."""
    if p.logit_bias:
        ids, biases = p.logit_bias_tensors
        row.index_add_(0, ids.to(row.device), biases.to(row.device))
    return _mask_and_penalize(row, p, seq, eos_token_ids)


def _mask_and_penalize(
    row: torch.Tensor, p: SamplingParams, seq: TokenHistory, eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """Step 1's ``min_tokens`` and step 2 on one row (after its bias or before: -inf plus a
    bias is -inf)."""
    vocab = row.numel()
    if p.min_tokens and len(seq.output_token_ids) < p.min_tokens:
        stops = [t for t in (*p.stop_token_ids, *eos_token_ids) if t < vocab]
        row[stops] = _NEG_INF
    rep, freq, pres = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
    if rep != 1.0 or freq or pres:
        out = torch.tensor(seq.output_token_ids, dtype=torch.int64, device=row.device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)  # [V]
        if rep != 1.0:
            seen = counts > 0  # [V]
            prompt = torch.tensor(seq.prompt_token_ids, dtype=torch.int64, device=row.device)
            seen[prompt[prompt < vocab]] = True
            # (in float64, back within float32's range: a penalty such as 1e-300 is 0 in
            # float32, and -inf * 0 is NaN; masked tokens stay masked)
            big = torch.finfo(row.dtype).max
            r64 = row.double()
            scaled = torch.where(r64 > 0, r64 / rep, r64 * rep).clamp(-big, big).to(row.dtype)
            row = torch.where(seen & torch.isfinite(row), scaled, row)
        if freq:
            row -= freq * counts
        if pres:
            row -= pres * (counts > 0).to(row.dtype)
        # (a tiny repetition_penalty divides a positive logit past float32's range: +inf would
        # make the row's softmax NaN; the largest finite value keeps the order)
        row = row.clamp_(max=torch.finfo(row.dtype).max)
    return row


def sampling_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Step 3 for a sampled row ``[V]``: the distribution its token is drawn from (float32).

    The row's maximum is subtracted before the temperature divides it: logits / 0.01 overflows
    float32 for logits past ~3e36, and softmax of an inf is NaN; this way the top token is 0 and
    the rest at worst -inf."""
    top = row.max()
    if not torch.isfinite(top):
        raise ValueError(
            f"cannot sample: the row's largest logit is {float(top)} (every token masked, or "
            "the model gave inf/nan)"
        )
    # (a temperature past float32's range would be inf, and -inf / inf is NaN)
    row = (row - top) / min(p.temperature, torch.finfo(row.dtype).max)  # [V], <= 0
    if p.min_p > 0.0:
        probs = row.softmax(-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), _NEG_INF)
    if 0 < p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, _NEG_INF)
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the tokens before it already reach top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= p.top_p
        drop[0] = False  # (a top_p below float32's smallest value compares as 0)
        row = row.scatter(0, order[drop], _NEG_INF)
    return row.softmax(-1)


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]
) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """Per row of ``logits [B, V]``: None where ``params.logprobs`` is None, else the chosen
    token's log-probability under the model's distribution (before penalties, biases,
    temperature, top-k, top-p, as vLLM reports them) and the ``params.logprobs`` most likely
    ``(token, logprob)``."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list = [None] * len(params)
    if not rows:
        return out
    logp = torch.log_softmax(logits[rows].float(), dim=-1)  # [R, V]
    k = max(params[i].logprobs for i in rows)
    top_v, top_i = torch.topk(logp, k, dim=-1) if k else (None, None)  # [R, k]
    chosen = (
        logp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=logp.device))
        .squeeze(1)
        .tolist()
    )
    top_v = top_v.tolist() if k else None
    top_i = top_i.tolist() if k else None
    for j, i in enumerate(rows):
        n = params[i].logprobs
        top = list(zip(top_i[j][:n], top_v[j][:n])) if n else []
        out[i] = (chosen[j], top)
    return out
