"""Expert load per expert rank: simulated (or recorded) routing, placement and replica choice.

The busiest expert rank sets every layer's pace, so the simulator needs, per expert rank, the
(token, expert) pairs it computes, the distinct experts it activates (weights it must read) and
the rows it receives (one per token and destination rank). They come from routing ``tokens``
tokens to ``top_k`` of ``num_experts`` experts, drawn without replacement from a popularity
vector: uniform, Zipf-skewed (``skew`` > 0: expert ``i`` of the shuffled order has weight
``1 / (i + 1) ** skew``), or recorded per-expert loads. Placement and balancing follow
ARCHITECTURE.md:

* ``"static"``: experts on ranks in contiguous ranges (the runtime's placement today), no replicas;
* ``"local"`` / ``"global"``: ``redundant`` extra slots replicate the hottest experts (greedy:
  each slot goes to the expert with the highest load per replica) and slots are packed
  longest-first onto the least-loaded rank (DeepSeek EPLB); each token's pair goes to a replica
  of its expert — ``"global"`` splits an expert's pairs evenly over its replicas (one decision
  from all attention ranks' counts), ``"local"`` lets every attention rank choose on its own
  (modelled as a uniformly random replica per pair).

Vectorised torch, a few samples (more for small token counts, until ~`MIN_SAMPLED_TOKENS`
tokens are drawn); results are cached per argument tuple.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

BALANCERS = ("static", "local", "global")
MAX_SAMPLED_TOKENS = 4096  # more tokens are sampled at this size and scaled (loads are flat there)
# Fewer tokens are drawn more times, until a load rests on about this many: the distinct experts
# of a decode micro-batch vary from draw to draw (10 tokens on 4 of 32 experts: 23.6 on average;
# 3 draws gave 25.0), and each one is a weight read
MIN_SAMPLED_TOKENS = 128
MAX_SAMPLES = 64


@dataclass(frozen=True)
class ExpertLoad:
    """Per-expert-rank load of one MoE layer, averaged over samples.

    pairs_max / pairs_mean: (token, expert) pairs on the busiest / an average rank;
    active_max / active_mean: distinct experts activated on a rank (max is of the pair-busiest);
    rows_mean: rows (token copies) an average rank receives; rows_max: on the busiest rank;
    rows_per_token: distinct destination ranks per token (dispatch copies);
    imbalance: pairs_max / pairs_mean (1.0 = perfect).
    """

    pairs_max: float
    pairs_mean: float
    active_max: float
    active_mean: float
    rows_max: float
    rows_mean: float
    rows_per_token: float

    @property
    def imbalance(self) -> float:
        return self.pairs_max / self.pairs_mean if self.pairs_mean else 1.0


def popularity(num_experts: int, skew: float, seed: int = 0) -> torch.Tensor:
    """``[num_experts]`` float64 routing weights summing to 1 (shuffled Zipf, exponent ``skew``)."""
    g = torch.Generator().manual_seed(seed)
    w = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** skew
    w = w[torch.randperm(num_experts, generator=g)]
    return w / w.sum()


def place(load: torch.Tensor, ranks: int, redundant: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EPLB-style placement of ``num_experts + redundant`` slots on ``ranks`` ranks.

    Returns ``replicas [num_experts]`` (copies of each expert) and ``slot_rank [S]`` with
    ``slot_expert [S]`` folded in as a ``[S, 2]`` tensor (expert, rank) per slot.
    """
    n = load.numel()
    replicas = torch.ones(n, dtype=torch.int64)
    for _ in range(redundant):  # a handful of slots: the loop is over slots, not tokens
        replicas[torch.argmax(load / replicas)] += 1
    slot_expert = torch.repeat_interleave(torch.arange(n), replicas)
    slot_load = (load / replicas)[slot_expert]
    per_rank = math.ceil(slot_expert.numel() / ranks)
    rank_load = torch.zeros(ranks, dtype=torch.float64)
    rank_fill = torch.zeros(ranks, dtype=torch.int64)
    slot_rank = torch.empty_like(slot_expert)
    for s in torch.argsort(slot_load, descending=True, stable=True).tolist():
        free = rank_fill < per_rank
        cand = torch.where(free, rank_load, torch.full_like(rank_load, math.inf))
        r = int(torch.argmin(cand))
        slot_rank[s] = r
        rank_load[r] += slot_load[s]
        rank_fill[r] += 1
    return replicas, torch.stack([slot_expert, slot_rank], dim=1)


def _static_slots(num_experts: int, ranks: int) -> torch.Tensor:
    base, extra = divmod(num_experts, ranks)
    sizes = torch.tensor([base + (1 if r < extra else 0) for r in range(ranks)])
    rank = torch.repeat_interleave(torch.arange(ranks), sizes)
    return torch.stack([torch.arange(num_experts), rank], dim=1)


def route(tokens: int, top_k: int, weights: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``[tokens, top_k]`` distinct experts per token, drawn without replacement (Gumbel top-k)."""
    # Gumbel top-k without logs: the top-k of w / Exp(1) is a draw without replacement
    noise = torch.empty(tokens, weights.numel(), dtype=torch.float32).exponential_(generator=g)
    keys = weights.float()[None, :] / noise  # [T, N]
    return torch.topk(keys, top_k, dim=1).indices


def _bucket(tokens: int) -> int:
    """Token counts above 64 snap to a grid of 16 steps per doubling (loads change smoothly)."""
    if tokens <= 64:
        return tokens
    return round(2 ** (round(math.log2(tokens) * 16) / 16))


def expert_load(
    tokens: int,
    num_experts: int,
    top_k: int,
    ranks: int,
    balancer: str = "static",
    redundant: int = 0,
    skew: float = 0.0,
    recorded: tuple[float, ...] | None = None,
    samples: int = 3,
    seed: int = 0,
) -> ExpertLoad:
    """Expected load of the busiest and an average of ``ranks`` expert ranks for one layer in
    which ``tokens`` tokens are routed (see the module doc). ``recorded``: per-expert loads
    observed in a real run, used as the popularity instead of ``skew``."""
    if balancer not in BALANCERS:
        raise ValueError(f"balancer={balancer!r} must be one of {BALANCERS}")
    if balancer == "static" and redundant:
        raise ValueError("redundant experts need a balancer ('local' or 'global')")
    if tokens <= 0:
        return ExpertLoad(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    b = _bucket(tokens)
    load = _expert_load(
        b, num_experts, top_k, ranks, balancer, redundant, skew, recorded, samples, seed
    )
    f = tokens / b
    return ExpertLoad(
        load.pairs_max * f,
        load.pairs_mean * f,
        load.active_max,
        load.active_mean,
        load.rows_max * f,
        load.rows_mean * f,
        load.rows_per_token,
    )


@lru_cache(maxsize=4096)
def _expert_load(
    tokens: int,
    num_experts: int,
    top_k: int,
    ranks: int,
    balancer: str = "static",
    redundant: int = 0,
    skew: float = 0.0,
    recorded: tuple[float, ...] | None = None,
    samples: int = 3,
    seed: int = 0,
) -> ExpertLoad:
    weights = (
        torch.tensor(recorded, dtype=torch.float64) / sum(recorded)
        if recorded
        else popularity(num_experts, skew, seed)
    )
    if weights.numel() != num_experts:
        raise ValueError(f"recorded routing has {weights.numel()} experts, model {num_experts}")
    if balancer == "static":
        slots = _static_slots(num_experts, ranks)
        replicas = torch.ones(num_experts, dtype=torch.int64)
    else:
        # Placement from the expected load (what EPLB sees after a warm-up period).
        replicas, slots = place(weights, ranks, redundant)
    sampled = min(tokens, MAX_SAMPLED_TOKENS)
    scale = tokens / sampled
    g = torch.Generator().manual_seed(seed + 1)
    # replica j of expert e is slot first_slot[e] + j (slots are grouped by expert)
    first_slot = torch.cumsum(replicas, 0) - replicas
    slot_rank = slots[:, 1]
    samples = max(samples, min(MAX_SAMPLES, -(-MIN_SAMPLED_TOKENS // sampled)))
    acc = torch.zeros(7, dtype=torch.float64)
    for _ in range(samples):
        ids = route(sampled, top_k, weights, g)  # [T, k]
        reps = replicas[ids]  # [T, k]
        if balancer == "global":
            # even split: the i-th pair of an expert (in token order) goes to replica i mod reps
            flat = ids.flatten()
            order = torch.argsort(flat, stable=True)
            seen = torch.zeros_like(flat)
            counts = torch.bincount(flat, minlength=num_experts)
            starts = torch.cumsum(counts, 0) - counts
            seen[order] = torch.arange(flat.numel()) - starts[flat[order]]
            choice = (seen % replicas[flat]).view_as(ids)
        else:
            r = torch.rand(ids.shape, generator=g, dtype=torch.float64)
            choice = (r * reps).long()
        rank = slot_rank[first_slot[ids] + choice]  # [T, k]
        pairs = torch.bincount(rank.flatten(), minlength=ranks).double()  # [R]
        hit = torch.zeros(sampled, ranks, dtype=torch.bool)
        hit.scatter_(1, rank, True)
        rows = hit.sum(0).double()  # [R]
        slot_of_pair = first_slot[ids] + choice
        active_slot = torch.zeros(slots.shape[0], dtype=torch.bool)
        active_slot[slot_of_pair.flatten()] = True
        active = torch.bincount(slot_rank[active_slot], minlength=ranks).double()
        busiest = int(torch.argmax(pairs))
        acc += torch.tensor(
            [
                pairs[busiest] * scale,
                pairs.mean() * scale,
                active[busiest],
                active.mean(),
                rows.max() * scale,
                rows.mean() * scale,
                hit.sum(1).double().mean(),
            ]
        )
    return ExpertLoad(*(acc / samples).tolist())
