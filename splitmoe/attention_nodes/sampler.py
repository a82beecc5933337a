"""Next-token sampling with per-request random streams."""

from __future__ import annotations

import secrets

import torch

from splitmoe.sampling_params import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """Seeded requests get their own stream, so their tokens do not depend on the batch or the
    topology they run in. Greedy requests need none."""
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return g


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """``logits [B, V]`` float32 -> one token id per row."""
    if logits.shape[0] == 0:
        return []
    tokens = logits.argmax(dim=-1).tolist()  # greedy rows keep these
    for i, (p, g) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        row = logits[i] / p.temperature  # [V]
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token once the tokens before it already reach top_p (the first always stays)
            drop = probs.cumsum(-1) - probs >= p.top_p
            row = row.scatter(0, order[drop], float("-inf"))
        probs = row.softmax(-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=g).item())
    return tokens
