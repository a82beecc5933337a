"""Who is who: a frozen description of the job's ranks, built once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from splitmoe.config import ParallelConfig


def contiguous_placement(num_experts: int, expert_ranks: int) -> tuple[int, ...]:
    """Expert ``e`` lives on expert rank ``owner[e]``; ranks get contiguous, near-equal ranges."""
    base, extra = divmod(num_experts, expert_ranks)
    owner = []
    for r in range(expert_ranks):
        owner += [r] * (base + (1 if r < extra else 0))
    return tuple(owner)


@dataclass(frozen=True)
class Topology:
    """Ranks ``0..A-1`` are attention ranks, ``A..A+E-1`` expert ranks (E = 0: colocated).

    Each MoE layer has ``num_experts + redundant`` expert *slots*; ``slot_owner[s]`` is the
    index (0..E-1) of the expert rank holding slot ``s`` (contiguous, near-equal ranges, fixed for
    the job). Which expert a slot holds is the `splitmoe.eplb.placement.Placement`; at
    start-up slot ``s`` holds expert ``s % num_experts`` (no replicas: slot id = expert id).
    """

    rank: int
    world_size: int
    num_attention: int
    num_expert: int
    local_rank: int
    local_world_size: int
    slot_owner: tuple[int, ...]
    ranks_per_node: int = 0  # 0: the whole world is one node
    num_experts: int = 0  # 0: one slot per expert (len(slot_owner))

    def __post_init__(self) -> None:
        if self.world_size != self.num_attention + self.num_expert:
            raise ValueError(
                f"world size {self.world_size} != attention ranks {self.num_attention} + "
                f"expert ranks {self.num_expert}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        if self.ranks_per_node == 0:
            object.__setattr__(self, "ranks_per_node", self.world_size)
        if self.num_experts == 0:
            object.__setattr__(self, "num_experts", len(self.slot_owner))

    @classmethod
    def build(
        cls,
        rank: int,
        parallel: ParallelConfig,
        num_experts: int,
        local_rank: int | None = None,
        local_world_size: int | None = None,
    ) -> Topology:
        world = parallel.world_size
        slots = num_experts + parallel.num_redundant
        owner = (
            contiguous_placement(slots, parallel.expert_ranks)
            if parallel.expert_ranks
            else tuple([0] * slots)
        )
        return cls(
            rank=rank,
            world_size=world,
            num_attention=parallel.attention_ranks,
            num_expert=parallel.expert_ranks,
            local_rank=rank if local_rank is None else local_rank,
            local_world_size=world if local_world_size is None else local_world_size,
            slot_owner=owner,
            num_experts=num_experts,
            ranks_per_node=parallel.ranks_per_node
            or (world if local_world_size is None else local_world_size),
        )

    @property
    def colocated(self) -> bool:
        return self.num_expert == 0

    @property
    def is_attention(self) -> bool:
        return self.rank < self.num_attention

    @property
    def role(self) -> str:
        return "attention" if self.is_attention else "expert"

    @property
    def attention_rank_ids(self) -> range:
        return range(self.num_attention)

    @property
    def expert_rank_ids(self) -> range:
        return range(self.num_attention, self.world_size)

    @property
    def expert_index(self) -> int:
        """Index of this rank among expert ranks (only for expert ranks)."""
        if self.is_attention:
            raise ValueError(f"rank {self.rank} is an attention rank")
        return self.rank - self.num_attention

    @property
    def expert_owner(self) -> tuple[int, ...]:
        """Expert rank of each slot id; without replicas slot ids are expert ids, so this is the
        owner of each expert."""
        return self.slot_owner

    @property
    def num_slots(self) -> int:
        return len(self.slot_owner)

    def slots_of(self, expert_index: int) -> list[int]:
        """Slot ids held by expert rank ``expert_index`` (local slot ``i`` is the ``i``-th)."""
        return [s for s, r in enumerate(self.slot_owner) if r == expert_index]

    def experts_of(self, expert_index: int) -> list[int]:
        """Routed experts of expert rank ``expert_index`` in the start-up placement, in local-slot
        order."""
        return [s % self.num_experts for s in self.slots_of(expert_index)]

    def node_of(self, rank: int) -> int:
        """Nodes are consecutive blocks of ``ranks_per_node`` ranks (the last may be smaller)."""
        return rank // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)

    def ranks_of_node(self, node: int) -> range:
        start = node * self.ranks_per_node
        return range(start, min(start + self.ranks_per_node, self.world_size))

    def describe(self) -> str:
        return f"rank {self.rank} ({self.role})"
