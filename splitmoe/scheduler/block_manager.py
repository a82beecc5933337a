"""KV block allocation for one attention rank's paged cache."""

from __future__ import annotations

from collections import deque


class BlockManager:
    """A free list of ``num_blocks`` KV blocks of ``block_size`` tokens.

    Blocks are handed out lowest id first and returned to the end of the free list, so allocation
    order is deterministic (tests assert exact ids).
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(block_table) <= self.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Extends ``block_table`` to hold ``num_tokens``; False (nothing taken) if full."""
        need = self.blocks_for(num_tokens) - len(block_table)
        if need > self.num_free:
            return False
        for _ in range(need):
            block_table.append(self.free_blocks.popleft())
        return True

    def free(self, block_table: list[int]) -> None:
        self.free_blocks.extend(block_table)
        block_table.clear()
