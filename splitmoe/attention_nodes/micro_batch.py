"""An attention rank's step split into micro-batches (ping-pong with the expert ranks): which
requests' tokens each takes, and their rows, built when a micro-batch runs."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import torch


def split_micro_batches(num_tokens: list[int], m: int) -> list[list[int]]:
    """Indices of the requests in each of ``m`` micro-batches, balanced by token count (longest
    first onto the lightest micro-batch; ties to the lowest index), each in batch order. Some may
    be empty: every micro-batch still takes part in the collectives."""
    n = len(num_tokens)
    if n and min(num_tokens) == max(num_tokens):  # (decode steps) this is round robin
        return [list(range(j, n, m)) for j in range(m)]
    loads = [(0, j) for j in range(m)]  # a heap of (tokens, micro-batch)
    parts: list[list[int]] = [[] for _ in range(m)]
    # longest first; sorted's stability keeps equal lengths in index order
    for i in sorted(range(n), key=num_tokens.__getitem__, reverse=True):
        load, j = loads[0]
        heapq.heapreplace(loads, (load + num_tokens[i], j))
        parts[j].append(i)
    return [sorted(p) for p in parts]


def select_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]`` for ascending ``rows``; ``t`` itself when they are all of its rows."""
    return t if len(rows) == t.shape[0] else t[rows]


class Lazy(Sequence):
    """``build(j)`` for j < n, each built once, on first access."""

    def __init__(self, n: int, build: Callable[[int], object]):
        self._n, self._build, self._items = n, build, {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, j: int):
        if not 0 <= j < self._n:
            raise IndexError(j)
        if j not in self._items:
            self._items[j] = self._build(j)
        return self._items[j]
