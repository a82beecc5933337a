"""Measures the per-message latency (alpha) and bandwidth (beta) of the links between ranks and
writes a profile that `splitmoe.comm.cost_model.CostModel.from_file` loads.

    python scripts/calibrate_comm.py --out out/comm/profile.json        # here: local gloo ranks
    torchrun --nnodes 2 --nproc-per-node 8 scripts/calibrate_comm.py --out profile.json

Ping-pong between rank 0 and a rank of its own node (``intra``) and rank 0 and the first rank of
the next node (``inter``), over message sizes from 8 B to ``--max-bytes``: a message's one-way
time is half the round trip (median of ``--reps``). ``alpha`` is the median one-way time of the
messages up to 2 KiB, ``1 / beta`` the least-squares slope over those of 64 KiB and more. Started
without torchrun, the script spawns ``--world`` local gloo ranks (nodes emulated on this machine:
both classes then cross the same loopback). ``phase_s`` is what an all-to-all of one small row
between every pair of ranks takes beyond the alpha-beta prediction (launch, synchronisation; on
an oversubscribed CPU, process wake-ups). Under torchrun the node size is
LOCAL_WORLD_SIZE and the backend NCCL when every rank has a GPU; a link class the job cannot
measure (one node only) keeps the default profile.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from splitmoe.comm.cost_model import IB_400G, NVLINK4, CostModel, LinkProfile, Phase  # noqa: E402
from splitmoe.comm.local_job import run_ranks  # noqa: E402


def ping_pong(rank: int, a: int, b: int, sizes: list[int], reps: int, device) -> list[float]:
    """One-way seconds per size between ranks ``a`` and ``b`` (measured on ``a``; others idle)."""
    out = []
    for size in sizes:
        buf = torch.zeros(size, dtype=torch.uint8, device=device)
        times = []
        for i in range(reps + 2):  # two warm-ups
            dist.barrier()
            if rank not in (a, b):
                continue
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if rank == a:
                dist.send(buf, b)
                dist.recv(buf, b)
            else:
                dist.recv(buf, a)
                dist.send(buf, a)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:
                times.append((time.perf_counter() - t0) / 2)
        out.append(statistics.median(times) if times else 0.0)
    return out


def fit(sizes: list[int], times: list[float]) -> LinkProfile:
    small = [t for s, t in zip(sizes, times) if s <= 2048] or times[:1]
    big = [(s, t) for s, t in zip(sizes, times) if s >= 64 * 1024] or list(zip(sizes, times))
    if len(big) >= 2:
        ms = statistics.fmean(s for s, _ in big)
        mt = statistics.fmean(t for _, t in big)
        slope = sum((s - ms) * (t - mt) for s, t in big) / sum((s - ms) ** 2 for s, _ in big)
    else:
        slope = big[0][1] / big[0][0]
    return LinkProfile(alpha_s=statistics.median(small), bytes_per_s=1.0 / max(slope, 1e-15))


def calibrate(rank: int, world: int, node_size: int, sizes: list[int], reps: int, device):
    pairs = {}
    if node_size >= 2:
        pairs["intra"] = (0, 1)
    if world > node_size:
        pairs["inter"] = (0, node_size)
    out = {cls: ping_pong(rank, a, b, sizes, reps, device) for cls, (a, b) in pairs.items()}
    out["all_to_all"] = all_to_all_time(world, reps, device)
    return out


def all_to_all_time(world: int, reps: int, device) -> float:
    """Median seconds (slowest rank) of an all-to-all of one 8-byte row to every other rank."""
    send = torch.zeros(world, 8, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    times = []
    for i in range(reps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send)
        if device.type == "cuda":
            torch.cuda.synchronize()
        spent = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)
        if i >= 2:
            times.append(float(spent))
    return statistics.median(times)


def fit_phase_s(model: CostModel, world: int, node_size: int, measured_s: float) -> float:
    """What the all-to-all took beyond the alpha-beta prediction for its messages."""
    node = torch.arange(world) // node_size
    rows = 1 - torch.eye(world, dtype=torch.int64)
    predicted = model.phase_time(Phase(rows, node[:, None] == node[None, :]), 8)
    return max(0.0, measured_s - predicted)


def _local_job(rank, world, node_size, sizes, reps):
    return calibrate(rank, world, node_size, sizes, reps, torch.device("cpu"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/comm/profile.json")
    ap.add_argument("--ranks-per-node", type=int, default=2, help="local emulation only")
    ap.add_argument("--world", type=int, default=6, help="local emulation: ranks to start")
    ap.add_argument("--max-bytes", type=int, default=1 << 24)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    sizes = [8]
    while sizes[-1] * 4 <= args.max_bytes:
        sizes.append(sizes[-1] * 4)

    if "RANK" in os.environ:  # torchrun / a launcher with env:// rendezvous
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        node_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        local = int(os.environ.get("LOCAL_RANK", 0))
        cuda = torch.cuda.is_available() and node_size <= torch.cuda.device_count()
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
        result = calibrate(rank, world, node_size, sizes, args.reps, device)
        backend = dist.get_backend()
        dist.destroy_process_group()
        if rank != 0:
            return
    else:
        node_size, world, backend = args.ranks_per_node, args.world, "gloo"
        if world <= node_size:
            ap.error("--world must exceed --ranks-per-node to emulate two nodes")
        result = run_ranks(_local_job, world, node_size, sizes, args.reps, timeout=1800.0)[0]

    a2a = result.pop("all_to_all")
    measured = {cls: fit(sizes, times) for cls, times in result.items()}
    links = CostModel(intra=measured.get("intra", NVLINK4), inter=measured.get("inter", IB_400G))
    model = CostModel(
        intra=links.intra,
        inter=links.inter,
        phase_s=fit_phase_s(links, world, node_size, a2a),
        name=f"measured-{platform.node()}-{backend}",
        source={
            "backend": backend,
            "world_size": world,
            "ranks_per_node": node_size,
            "sizes": sizes,
            "one_way_s": result,
            "all_to_all_s": a2a,
            "defaulted": sorted({"intra", "inter"} - set(measured)),
        },
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model.to_file(out)
    for cls in ("intra", "inter"):
        p = model.link(cls)
        tag = " (default)" if cls not in measured else ""
        print(f"{cls}: alpha {p.alpha_s * 1e6:.1f} us, beta {p.bytes_per_s / 1e9:.2f} GB/s{tag}")
    print(
        f"all-to-all over {world} ranks: {a2a * 1e6:.1f} us -> phase_s {model.phase_s * 1e6:.1f} us"
    )
    print(f"profile written to {out}")


if __name__ == "__main__":
    main()
