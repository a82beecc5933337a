"""Data-parallel routing: which attention rank serves a new request."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class LeastLoadRouter:
    """Sends each request to the attention rank with the least load, in tokens: those its
    unfinished requests hold in the KV cache plus those still queued. The caller adds a request's
    cost when it is routed (`pick`), grows it as tokens are generated (`add`) and takes it all
    back when the request finishes (`release`). Ties go to the lowest rank, so the choice is
    deterministic: every rank replaying the same requests reaches the same assignment.

    With prefix caching the caller also passes the prompt's chained block hashes, salted as the
    ranks salt them (`block_manager.block_hashes`): among the ranks whose load is close to the
    lightest (within the request's own cost, or a quarter of the lightest load), the one that
    most likely holds the longest cached prefix wins. What a
    rank holds is estimated from the prompts routed to it (the last ``capacity`` blocks'
    worth, least recently routed forgotten first), as SGLang's cache-aware router does: the
    front end never asks the ranks, so routing costs no round trip."""

    def __init__(self, num_ranks: int, capacity: int = 0):
        self.load = [0] * num_ranks
        self.capacity = capacity  # blocks remembered per rank (0: no prefix awareness)
        self._prefixes: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_ranks)]
        self._ranks = list(range(num_ranks))  # the ranks still taking requests

    def retire(self, rank: int) -> None:
        """``rank`` takes no more requests (fault tolerance: it was lost)."""
        if rank in self._ranks and len(self._ranks) > 1:
            self._ranks.remove(rank)

    def pick(self, cost: int, hashes: Sequence[bytes] = ()) -> int:
        ranks = self._ranks
        rank = min(ranks, key=lambda r: (self.load[r], r))
        if hashes and self.capacity:
            close = self.load[rank] + max(cost, self.load[rank] // 4)
            best = self.cached_prefix(rank, hashes)
            for r in ranks:
                hit = self.cached_prefix(r, hashes) if self.load[r] <= close else 0
                if hit > best:
                    rank, best = r, hit
            seen = self._prefixes[rank]
            for h in hashes:
                seen[h] = None
                seen.move_to_end(h)
            while len(seen) > self.capacity:
                seen.popitem(last=False)
        self.load[rank] += cost
        return rank

    def cached_prefix(self, rank: int, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` ``rank`` is thought to hold."""
        seen = self._prefixes[rank]
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def add(self, rank: int, tokens: int) -> None:
        self.load[rank] += tokens

    def release(self, rank: int, tokens: int) -> None:
        self.load[rank] -= tokens
