"""Data-parallel routing: which attention rank serves a new request."""

from __future__ import annotations


class LeastLoadRouter:
    """Sends each request to the attention rank with the least outstanding work (prompt +
    max_tokens of its unfinished requests); ties go to the lowest rank, so the choice is
    deterministic and every rank that replays the same requests reaches the same assignment."""

    def __init__(self, num_ranks: int):
        self.load = [0] * num_ranks

    def pick(self, cost: int) -> int:
        rank = min(range(len(self.load)), key=lambda r: (self.load[r], r))
        self.load[rank] += cost
        return rank

    def release(self, rank: int, cost: int) -> None:
        self.load[rank] -= cost
