"""Prefix-cache block hashing: chained SHA-256 digests per second (`block_hashes`) beside
Python's ``hash()`` of token tuples, the scheme it replaced, for one prompt.

    python scripts/bench_block_hashes.py                       # 4096 tokens, block 16
    python scripts/bench_block_hashes.py --tokens 50000 --block-size 16 --salt tenant-a
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from splitmoe.scheduler.block_manager import block_hashes


def python_hash(token_ids: list[int], block_size: int) -> list[int]:
    """The scheme before SHA-256: ``hash()`` chained over tuples (predictable, collidable)."""
    out, parent = [], None
    for s in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[s : s + block_size])))
        out.append(parent)
    return out


def time_per_call(fns: dict, reps: int) -> dict[str, float]:
    """Median seconds per call of each function over ``reps`` rounds of about 0.2 s each, the
    functions alternating round by round (so a neighbour's load on shared cores hits all)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            n, t0 = 0, time.perf_counter()
            while (dt := time.perf_counter() - t0) < 0.2:
                fn()
                n += 1
            times[name].append(dt / n)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--salt", default=None)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(0)
    ids = [rng.randrange(args.vocab) for _ in range(args.tokens)]
    blocks = args.tokens // args.block_size
    print(f"{args.tokens} tokens, block {args.block_size}: {blocks} blocks per prompt")
    fns = {
        "sha256": lambda: block_hashes(ids, args.block_size, salt=args.salt),
        "hash()": lambda: python_hash(ids, args.block_size),
    }
    for name, t in time_per_call(fns, args.reps).items():
        print(
            f"{name:>7}: {t * 1e6:8.1f} us per prompt, {blocks / t / 1e6:6.2f} M blocks/s, "
            f"{t / args.tokens * 1e9:6.1f} ns per token"
        )


if __name__ == "__main__":
    main()
