"""KV block allocation for one attention rank's paged cache."""

from __future__ import annotations


class BlockManager:
    """A free list of ``num_blocks`` KV blocks of ``block_size`` tokens.

    A stack: the most recently freed blocks are handed out first (in the order their request
    held them), then the never-used ones lowest id first, so allocation order is deterministic
    (tests assert exact ids). Reusing warm blocks keeps a request's writes on pages the cache
    already has; handed out oldest first, each run of a CPU benchmark went on to fresh pages of
    the pool, zeroed by the kernel at first touch (~10% of a colocated decode step in `perf`;
    batch 32 decoded 1.03x faster with the stack, CPU, paired runs).
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # (the top is the end)

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
            block_table.append(self.free_blocks.pop())
        return True

    def free(self, block_table: list[int]) -> None:
        self.free_blocks.extend(reversed(block_table))
        block_table.clear()
