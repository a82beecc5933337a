"""Expert placement: which logical expert each slot of each MoE layer holds.

A job has ``S = num_experts + redundant`` slots per MoE layer, spread over the expert ranks in
rank-major order: expert rank ``r`` holds the contiguous slot ids ``offset[r] .. offset[r+1]-1``
(near-equal counts, as `splitmoe.comm.topology.contiguous_placement`). Slot -> rank and slot ->
local slot are therefore fixed for the whole job; a placement only says which expert each slot
holds (``slot_expert [L, S]``), so a rebalance moves weights, never changes the transport's tables.

* `Placement.initial`: slot ``s`` holds expert ``s % num_experts``: with no replicas this is the
  contiguous placement (slot id = expert id); with ``R`` replicas experts ``0..R-1`` get a second
  copy in the last slots, always on another rank (a rank holds fewer than ``num_experts + 1``
  consecutive slots).
* `Placement.plan` (DeepSeek EPLB-style, per layer, from per-expert token counts over a window):
  each extra slot replicates the expert with the highest load per replica (at most one copy per
  rank); replicas are packed longest-first onto the least-loaded rank with a free slot that does
  not hold the expert yet; an expert that stays on a rank keeps its local slot (fewer weights move).

Every rank builds the same object from the same inputs (integer counts, plain-Python integer and
float arithmetic, ties to the lowest id), so no placement ever travels over the network.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from splitmoe.comm.topology import contiguous_placement
from splitmoe.config import check_fits


@dataclass(frozen=True)
class Placement:
    """``slot_expert [L, S]`` int64: the logical expert of every slot of every MoE layer
    (``layers[i]`` is the model layer of row ``i``); ``slot_rank [S]`` / ``slot_local [S]``:
    expert-rank index and local slot id of each slot (the same for every layer); ``version``
    counts rebalances."""

    num_experts: int
    num_ranks: int
    layers: tuple[int, ...]
    slot_expert: torch.Tensor
    version: int = 0

    def __post_init__(self) -> None:
        owner = torch.tensor(contiguous_placement(self.num_slots, self.num_ranks))
        local = (
            torch.arange(self.num_slots)
            - (torch.cumsum(self.slots_per_rank, 0) - self.slots_per_rank)[owner]
        )
        object.__setattr__(self, "slot_rank", owner)
        object.__setattr__(self, "slot_local", local)

    @property
    def num_slots(self) -> int:
        return self.slot_expert.shape[1]

    @property
    def slots_per_rank(self) -> torch.Tensor:
        base, extra = divmod(self.num_slots, self.num_ranks)
        return torch.tensor([base + (r < extra) for r in range(self.num_ranks)])

    @property
    def redundant(self) -> int:
        return self.num_slots - self.num_experts

    def row(self, layer: int) -> torch.Tensor:
        """``[S]`` experts of the slots of model layer ``layer``."""
        return self.slot_expert[self.layers.index(layer)]

    def experts_on(self, rank: int) -> dict[int, list[int]]:
        """Per MoE layer, the experts expert rank ``rank`` holds, in local-slot order."""
        mine = self.slot_rank == rank
        return {layer: self.slot_expert[i, mine].tolist() for i, layer in enumerate(self.layers)}

    def moved(self, other: Placement, rank: int) -> dict[int, list[int]]:
        """Per layer, the local slots of ``rank`` whose expert differs in ``other`` (the weights
        a rebalance from ``self`` to ``other`` must bring to that rank)."""
        mine = self.slot_rank == rank
        changed = (self.slot_expert != other.slot_expert)[:, mine]  # [L, slots of rank]
        return {
            layer: changed[i].nonzero().flatten().tolist()
            for i, layer in enumerate(self.layers)
            if changed[i].any()
        }

    @classmethod
    def initial(
        cls, num_experts: int, num_ranks: int, redundant: int, layers: tuple[int, ...]
    ) -> Placement:
        check_fits(num_experts, num_ranks, redundant)
        row = torch.arange(num_experts + redundant) % num_experts  # [S]
        return cls(num_experts, num_ranks, tuple(layers), row.repeat(len(layers), 1))

    def without(self, lost: list[int], grow: bool = False) -> Placement:
        """The placement after losing expert ranks ``lost`` (indices 0..num_ranks-1): the
        survivors keep every slot they hold, in order, and are renumbered 0..n-1; each expert
        that only a lost rank held takes a slot holding a replica (an expert held more than once
        among the survivors: the most replicated first, its last slot), whose weights the rank
        reads again from the checkpoint. ValueError when an expert fits nowhere (no replica
        slot left), or no rank survives. Version + 1; every rank computes the same.

        ``grow``: where the survivors hold fewer slots than experts (then no layer's replica
        slots can take all of its lost experts), they grow to one slot per expert, spread
        near-equally (contiguous ranges again: each survivor keeps its slots first, in place,
        and gets the new ones after them); in every layer the lost experts fill the new slots
        first (each layer lacks at least as many experts as there are new slots), then replica
        slots as above."""
        keep = [r for r in range(self.num_ranks) if r not in lost]
        if not keep:
            raise ValueError(f"every expert rank is lost ({sorted(lost)}): no expert survives")
        kept = torch.isin(self.slot_rank, torch.tensor(keep))  # [S]
        held = self.slots_per_rank[keep].tolist()  # the survivors' slots, in rank order
        slots = max(sum(held), self.num_experts) if grow else sum(held)
        counts = _near_equal(slots, len(keep))
        # near-equal counts of survivors of a near-equal split are a non-increasing run of
        # base / base + 1: the near-equal split of as many slots or more gives each as many or
        # more, so every survivor's local slots stay put
        if any(c < h for c, h in zip(counts, held)):
            raise ValueError(
                f"the survivors' slot counts {held} are not contiguous near-equal ranges of "
                f"{slots} slots"
            )
        out = []
        for i, layer in enumerate(self.layers):
            row = _with_new_slots(self.slot_expert[i, kept].tolist(), held, counts)
            for e in sorted(set(range(self.num_experts)) - set(row)):
                if None in row:  # a new slot
                    row[row.index(None)] = e
                    continue
                copies = {x: row.count(x) for x in row}
                spare = [j for j, x in enumerate(row) if copies[x] > 1]
                if not spare:
                    raise ValueError(
                        f"layer {layer}: expert {e} was held only by the lost expert rank(s) "
                        f"{sorted(lost)} and no survivor has a replica slot to take it "
                        "(more redundant_experts would leave room)"
                    )
                j = max(spare, key=lambda j: (copies[row[j]], j))
                row[j] = e
            out.append(row)
        return Placement(
            self.num_experts, len(keep), self.layers, torch.tensor(out), self.version + 1
        )

    def plan(self, load: torch.Tensor) -> Placement:
        """The next placement from ``load [L, E]`` (int, tokens per expert over a window, the
        same on every rank); version + 1."""
        load = load.to(torch.int64).cpu()
        rows = [
            _plan_layer(
                load[i].tolist(),
                self.num_ranks,
                self.redundant,
                self.slots_per_rank.tolist(),
                self.slot_expert[i].tolist(),
            )
            for i in range(len(self.layers))
        ]
        return Placement(
            self.num_experts, self.num_ranks, self.layers, torch.tensor(rows), self.version + 1
        )


def _near_equal(slots: int, ranks: int) -> list[int]:
    """Slots per rank of ``slots`` spread over ``ranks`` in contiguous near-equal ranges (the
    first ranks one more), as `Placement.slots_per_rank`."""
    base, extra = divmod(slots, ranks)
    return [base + (r < extra) for r in range(ranks)]


def _with_new_slots(row: list[int], held: list[int], counts: list[int]) -> list[int | None]:
    """One layer's kept slots (``held[i]`` of rank ``i``'s, in order) laid out on ``counts``
    slots per rank: each rank's kept slots, then its new ones (None)."""
    out: list[int | None] = []
    at = 0
    for h, c in zip(held, counts):
        out += row[at : at + h] + [None] * (c - h)
        at += h
    return out


def _plan_layer(
    load: list[int], ranks: int, redundant: int, capacity: list[int], previous: list[int]
) -> list[int]:
    """One layer's ``slot -> expert`` (see the module doc). Loops over slots, off the hot path
    (~300 slots per layer: well under a millisecond)."""
    n = len(load)
    load = [max(x, 0) + 1 for x in load]  # +1: unseen experts still count, ties stay defined
    replicas = [1] * n
    # highest load per replica first; ties to the lowest expert id
    heap = [(-load[e], e) for e in range(n)]
    heapq.heapify(heap)
    for _ in range(redundant):
        while True:
            _, e = heapq.heappop(heap)
            if replicas[e] < ranks:
                break
        replicas[e] += 1
        if replicas[e] < ranks:
            heapq.heappush(heap, (-load[e] / replicas[e], e))
    items = sorted(
        ((load[e] / replicas[e], e) for e in range(n) for _ in range(replicas[e])),
        key=lambda t: (-t[0], t[1]),
    )
    rank_load = [0.0] * ranks
    free = list(capacity)
    held: list[list[int]] = [[] for _ in range(ranks)]
    for w, e in items:
        cands = [r for r in range(ranks) if free[r] and e not in held[r]]
        if cands:
            r = min(cands, key=lambda r: (rank_load[r], r))
        else:
            # every rank with room already holds e: swap with an expert f held by some rank q
            # without e, where f is not on the free rank r
            r = min((r for r in range(ranks) if free[r]), key=lambda r: (rank_load[r], r))
            q, f = next(
                (q, f)
                for q in range(ranks)
                if e not in held[q]
                for f in held[q]
                if f not in held[r]
            )
            held[q].remove(f)
            held[q].append(e)
            held[r].append(f)
            free[r] -= 1
            rank_load[r] += w
            continue
        held[r].append(e)
        free[r] -= 1
        rank_load[r] += w
    # local slot order: an expert already on the rank keeps its slot; the others fill the rest
    out: list[int] = []
    start = 0
    for r in range(ranks):
        old = previous[start : start + capacity[r]]
        new = sorted(held[r])
        row: list[int | None] = [e if e in new else None for e in old]
        kept = {e for e in row if e is not None}
        # an expert can appear once per rank; duplicates in old cannot happen
        rest = iter(e for e in new if e not in kept)
        out += [e if e is not None else next(rest) for e in row]
        start += capacity[r]
    return out
