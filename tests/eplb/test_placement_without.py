"""`Placement.without`: the placement after losing expert ranks (fault tolerance): replica
slots first, and with ``grow`` new slots where no replica slot is left."""

from __future__ import annotations

import pytest
import torch

from splitmoe.eplb.placement import Placement


def _ranks(p: Placement, layer: int = 0) -> list[list[int]]:
    """Each rank's experts of one layer, in local-slot order."""
    return list(p.experts_on(r)[p.layers[layer]] for r in range(p.num_ranks))


def test_replica_slots_take_a_lost_ranks_experts():
    p = Placement.initial(8, 3, 4, (0, 1))  # [0 1 2 3 | 4 5 6 7 | 0 1 2 3]
    q = p.without([1])
    assert _ranks(q) == [[0, 1, 2, 3], [7, 6, 5, 4]]
    assert q.version == 1 and q.redundant == 0
    assert p.without([1], grow=True).slot_expert.tolist() == q.slot_expert.tolist()


def test_no_spare_slot_raises_unless_the_survivors_grow():
    """16 experts on 3 ranks, no replicas (6 + 5 + 5 slots): the middle rank's 5 experts fit no
    replica slot; growing, the survivors hold 8 each, their own slots first and in place."""
    p = Placement.initial(16, 3, 0, (0, 1, 2, 3))
    with pytest.raises(ValueError, match="no survivor has a replica slot"):
        p.without([1])
    q = p.without([1], grow=True)
    assert q.slots_per_rank.tolist() == [8, 8] and q.redundant == 0 and q.version == 1
    for layer in range(4):
        mine = _ranks(q, layer)
        assert mine[0][:6] == list(range(6)) and mine[1][:5] == list(range(11, 16))
        assert sorted(mine[0] + mine[1]) == list(range(16))


def test_growth_fills_new_slots_first_then_replica_slots():
    """2 ranks of 6 slots, 8 experts; rank 1 lost leaves 6 slots: the survivor grows to 8.
    Layer 0 lacks experts 6, 7 (the new slots); layer 1 lacks 4 to 7 but holds 0 and 1 twice:
    4 and 5 take the new slots, 6 and 7 the slots of the second copies of 1 and 0."""
    rows = torch.tensor(
        [[0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7], [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]
    )
    q = Placement(8, 2, (0, 1), rows).without([1], grow=True)
    assert q.slots_per_rank.tolist() == [8] and q.redundant == 0
    assert _ranks(q, 0) == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert _ranks(q, 1) == [[0, 1, 2, 3, 7, 6, 4, 5]]


def test_growing_where_replica_slots_suffice_changes_nothing():
    """Survivors holding a slot per expert or more never grow."""
    p = Placement.initial(6, 3, 3, (0, 1))  # [0 1 2 | 3 4 5 | 0 1 2]
    assert p.without([1], grow=True).slot_expert.tolist() == p.without([1]).slot_expert.tolist()
    assert p.without([1], grow=True).slots_per_rank.tolist() == [3, 3]
