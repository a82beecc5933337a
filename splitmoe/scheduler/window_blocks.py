"""KV blocks of the sliding-window layers (GPT-OSS), freed once they fall out of the window.

A model whose layers mix sliding-window and full attention keeps two KV groups, as vLLM v1's
KV-cache groups do: the full layers in one pool whose blocks a request holds to its end
(`BlockManager`), the sliding-window layers in a pool of their own with its own block ids. A
request has a block table in each (``Request.block_table``, ``Request.window_table``); entry j of
both holds tokens ``j * block_size ..`` of its layers, so positions and slots are computed the
same way. Before each step, the window table's blocks that no query from the request's next
token on can see (every token before ``next - window + 1``) go back to the free list and their
entries point to the null block (block 0 of the window pool, never handed out, never written).
The attention kernels never read keys before a query's window (the reference reads them
masked), so a freed entry is never used. A request thus holds at most ``(window - 1) //
block_size + 2`` window blocks plus those of its current chunk, whatever its length.
"""

from __future__ import annotations

from splitmoe.scheduler.block_manager import BlockManager

NULL_BLOCK = 0


class SlidingWindowBlocks(BlockManager):
    """`BlockManager` of the sliding-window layers' pool: `grow` first frees the blocks that fell
    out of the window; ``peak_used`` is the most blocks held at once."""

    def __init__(self, num_blocks: int, block_size: int, window: int):
        if num_blocks < 2:
            raise ValueError("the sliding-window KV pool needs a null block and at least one more")
        super().__init__(num_blocks, block_size)
        self.free_blocks.remove(NULL_BLOCK)  # entries of freed blocks point to it
        self.window = window
        self.peak_used = 0

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free_blocks)

    def release(self, block_table: list[int], next_pos: int) -> int:
        """Frees the blocks of ``block_table`` that no query at ``next_pos`` or later sees (all
        their tokens before ``next_pos - window + 1``); returns how many. Freed entries form a
        prefix of the table, so the scan stops at the first null entry (O(1) per step)."""
        j = min(len(block_table), max(0, next_pos - self.window + 1) // self.block_size) - 1
        n = 0
        while j >= 0 and block_table[j] != NULL_BLOCK:
            self.free_blocks.append(block_table[j])
            block_table[j] = NULL_BLOCK
            j -= 1
            n += 1
        return n

    def grow(self, block_table: list[int], num_tokens: int, next_pos: int = 0) -> bool:
        """`release` for a step whose first query is at ``next_pos``, then `BlockManager.grow`."""
        self.release(block_table, next_pos)
        ok = super().grow(block_table, num_tokens)
        self.peak_used = max(self.peak_used, self.num_used)
        return ok

    def free(self, block_table: list[int]) -> None:
        self.free_blocks.extend(b for b in reversed(block_table) if b != NULL_BLOCK)
        block_table.clear()
