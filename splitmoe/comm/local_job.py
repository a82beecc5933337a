"""Run a function on several local gloo ranks in fresh processes and collect what each returns.

For tests and measurement scripts (``scripts/bench_comm.py``, ``scripts/calibrate_comm.py``):
``run_ranks(fn, world, *args)`` calls ``fn(rank, world, *args)`` on every rank with a gloo
process group already up, and returns the results by rank. A rank that raises fails the call
with its traceback; ranks that hang fail it after ``timeout``.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, init_method, args, out_q):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        dist.destroy_process_group()
        # plain pickle: tensors travel by value, not as shared memory that dies with this process
        out_q.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        out_q.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world: int, *args, timeout: float = 120.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` local gloo ranks; returns the results by rank."""
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, init, args, out_q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < world:
            try:
                rank, status, value = out_q.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(world)) - set(results))
                raise TimeoutError(f"ranks {missing} hung") from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
