"""``splitmoe tune-cpu --model CKPT [engine options]``: measures every CPU kernel choice a job
of these options meets, thoroughly, and writes them to the cache file of kernel choices.

A rank settles its classes at start-up within a few seconds (`splitmoe.kernels.settle`); this
measures them all ahead of time, with more timings per class (``--per-class-s``), so that
every later start on this machine finds them in the file and measures nothing. It loads the
weights one rank of each kind holds (an attention rank, with its experts when colocated; each
expert rank whose slot counts differ), at the thread count such a rank runs with, in this
process, one kind after the other, and prints a table of the decisions. Without ``--keep`` every
class is measured again (a decision in the file is replaced).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from splitmoe.attention_nodes.model import AttentionModel
from splitmoe.comm.topology import Topology
from splitmoe.config import EngineConfig
from splitmoe.eplb.placement import Placement
from splitmoe.expert_nodes.experts import LocalExperts
from splitmoe.kernels.backends import attention_backend, moe_backend
from splitmoe.kernels.cpu_choice import DEFAULT_FILE, settle
from splitmoe.kernels.settle import Shapes, model_trials
from splitmoe.models.default_model import resolve_model
from splitmoe.models.loader import load_attention_weights
from splitmoe.options import add_engine_args, engine_args, engine_config
from splitmoe.runtime import keep_freed_memory, rank_openmp_env, set_threads


def rank_kinds(cfg: EngineConfig) -> list[int]:
    """One rank of each kind whose kernel classes differ: attention rank 0, and the first
    expert rank of each distinct count of slots per layer (`Placement.initial`)."""
    par, m = cfg.parallel, cfg.model
    ranks = [0]
    if par.expert_ranks:
        placement = Placement.initial(m.num_experts, par.expert_ranks, par.num_redundant,
                                      m.moe_layers)  # fmt: skip
        seen = set()
        for e in range(par.expert_ranks):
            slots = tuple(len(ids) for ids in placement.experts_on(e).values())
            if slots not in seen:
                seen.add(slots)
                ranks.append(par.attention_ranks + e)
    return ranks


def _rank_pieces(cfg: EngineConfig, rank: int):
    """``(model, experts, shapes)`` of rank ``rank``: its `AttentionModel` (attention ranks) and
    `LocalExperts` (expert ranks, and colocated attention ranks), as the rank loads them."""
    par, m, dtype, cpu = cfg.parallel, cfg.model, cfg.torch_dtype, torch.device("cpu")
    model = experts = None
    if rank < par.attention_ranks:
        globals_, layers = load_attention_weights(m, dtype, "cpu")
        model = AttentionModel(m, globals_, layers, cpu, attention_backend(cfg.attention_backend,
                               cpu), compile=cfg.compile_model)  # fmt: skip
        if not par.expert_ranks:
            ids = list(range(m.num_experts))
            experts = LocalExperts(m, ids, dtype, cpu, moe_backend(cfg.moe_backend, cpu))
    else:
        placement = Placement.initial(m.num_experts, par.expert_ranks, par.num_redundant,
                                      m.moe_layers)  # fmt: skip
        ids = placement.experts_on(rank - par.attention_ranks)
        experts = LocalExperts(m, ids, dtype, cpu, moe_backend(cfg.moe_backend, cpu))
    return model, experts, Shapes.of(cfg, expert_rank=rank >= par.attention_ranks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="splitmoe tune-cpu", description=__doc__.split("\n\n")[0].replace("``", "")
    )
    ap.add_argument("--model", required=True, help="checkpoint directory (or a built-in preset)")
    ap.add_argument(
        "--per-class-s",
        type=float,
        default=0.25,
        help="seconds of timed calls per shape class, at least 3 of each candidate "
        "(a rank's start-up takes 0.05)",
    )
    ap.add_argument("--max-rounds", type=int, default=100, help="timed calls per candidate at most")
    ap.add_argument(
        "--keep", action="store_true", help="measure only the classes the cache file lacks"
    )
    add_engine_args(ap, exclude=("device",))
    args = ap.parse_args(argv)
    cfg = engine_config(resolve_model(args.model), device="cpu", **engine_args(args))
    # (OpenMP reads its environment when it loads: a rank's is set before it starts, so this
    # process starts again with it)
    omp = rank_openmp_env(cfg, cfg.parallel.world_size)
    if any(os.environ.get(k) != v for k, v in omp.items()):
        again = sys.argv[1:] if argv is None else argv
        cmd = [sys.executable, "-m", "splitmoe.tune_cpu", *again]
        return subprocess.run(cmd, env={**os.environ, **omp}).returncode
    keep_freed_memory()  # (as a rank: freed temporaries are reused, not faulted in again)
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    threads = torch.get_num_threads()
    print(f"cpu kernel choices for {cfg.model.path} ({cfg.torch_dtype}), file {DEFAULT_FILE.path}")
    total = 0.0
    for rank in rank_kinds(cfg):
        topo = Topology.build(rank, cfg.parallel, cfg.model.num_experts)
        try:
            set_threads(cfg, topo)  # (and its cores, as the rank would be pinned)
            model, experts, shapes = _rank_pieces(cfg, rank)
            t0 = time.perf_counter()
            trials = model_trials(shapes, cfg.torch_dtype, model, experts)
            with DEFAULT_FILE.turn():  # (not while a rank of this host measures)
                DEFAULT_FILE.refresh()
                report = settle(
                    trials, None, fresh=not args.keep, per_class_s=args.per_class_s,
                    max_rounds=args.max_rounds,
                )  # fmt: skip
            total += time.perf_counter() - t0
            rank_threads = torch.get_num_threads()
        finally:
            torch.set_num_threads(threads)
            if affinity is not None:
                os.sched_setaffinity(0, affinity)
        print(f"\n{topo.describe()}, {rank_threads} threads: {report.summary()}")
        print(report.table())
        del model, experts
    print(f"\n{total:.1f} s; decisions in {DEFAULT_FILE.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
