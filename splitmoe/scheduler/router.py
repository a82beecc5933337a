"""Data-parallel routing: which attention rank serves a new request."""

from __future__ import annotations


class LeastLoadRouter:
    """Sends each request to the attention rank with the least load, in tokens: those its
    unfinished requests hold in the KV cache plus those still queued. The caller adds a request's
    cost when it is routed (`pick`), grows it as tokens are generated (`add`) and takes it all
    back when the request finishes (`release`). Ties go to the lowest rank, so the choice is
    deterministic: every rank replaying the same requests reaches the same assignment."""

    def __init__(self, num_ranks: int):
        self.load = [0] * num_ranks

    def pick(self, cost: int) -> int:
        rank = min(range(len(self.load)), key=lambda r: (self.load[r], r))
        self.load[rank] += cost
        return rank

    def add(self, rank: int, tokens: int) -> None:
        self.load[rank] += tokens

    def release(self, rank: int, tokens: int) -> None:
        self.load[rank] -= tokens
