"""Flat vs two-phase vs auto attention<->expert exchange: measured here, predicted for real links.

    python scripts/calibrate_comm.py --out out/comm/profile.json    # this machine's profile
    python scripts/bench_comm.py --here-profile out/comm/profile.json
    python scripts/bench_comm.py --skip-measure        # cost-model predictions only (seconds)

*Measured*: for each emulated node layout ``A+E:g`` (A attention ranks, E expert ranks, g ranks
per node) the script starts ``A+E`` gloo ranks on this machine and times one MoE layer (dispatch +
combine on attention ranks, receive + send-back on expert ranks, an identity expert in between)
for every transport, hidden size and token count per attention rank, with uniform random top-k
routing. The figure is the median over repetitions of the slowest rank. Messages and bytes per
layer and link class come from the transports' own counters (`Transport.stats_snapshot`), and
``pred_here_ms`` is the cost model with ``--here-profile`` (a profile of this machine written by
`scripts/calibrate_comm.py`), with which ``auto@here`` also runs next to ``auto``.

*Predicted*: for 8-GPU nodes (NVLink 4 inside, 400 Gb/s InfiniBand between, or ``--profile``)
the cost model's per-layer time of both schemes (bf16; every attention rank routes its first
``T`` tokens of one seeded uniform top-k sample, so counts grow with ``T`` as in a real batch),
the inter-node messages per layer and direction, what ``auto`` picks, and the crossover: the
smallest token count per attention rank from which ``auto`` picks flat (the scan over every ``T``
also lists later switches, where sampling noise makes both schemes nearly equal).

CSV files go to ``--out`` (measured.csv, predicted.csv, crossover.csv); tables are printed.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import torch

from splitmoe.comm.cost_model import CostModel
from splitmoe.comm.local_job import run_ranks
from splitmoe.comm.topology import Topology
from splitmoe.comm.transports import TRANSPORTS
from splitmoe.comm.two_phase import NodeLayout, scheme_times
from splitmoe.config import ParallelConfig, resolve_dtype

TRANSPORT_NAMES = ("flat", "two_phase", "auto")


def variants(here_profile: str | None) -> tuple[str, ...]:
    """Measured transports; ``auto@here``: auto with this machine's calibrated profile."""
    return TRANSPORT_NAMES + (("auto@here",) if here_profile else ())


# hidden size -> (routed experts, top-k) of a model of that width, for the predictions
MODELS = {2048: (128, 8), 4096: (128, 8), 7168: (256, 8)}  # Qwen3-30B-A3B, -235B-A22B, DSv3


# ---- shared helpers ---------------------------------------------------------------------------
def parse_layout(text: str) -> tuple[int, int, int]:
    """``"4+2:2"`` -> (attention ranks, expert ranks, ranks per node)."""
    ranks, _, g = text.partition(":")
    a, _, e = ranks.partition("+")
    return int(a), int(e), int(g or int(a) + int(e))


def routing(tokens: int, num_experts: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, num_experts, generator=g).topk(top_k, dim=1).indices  # [T, k]
    return ids, torch.rand(tokens, top_k, generator=g)


def prefix_counts(
    topo: Topology, max_tokens: int, num_experts: int, top_k: int, seed: int = 0
) -> torch.Tensor:
    """``[A, max_tokens, E]`` int32: ``[a, T - 1, j]`` = rows attention rank ``a`` sends expert
    rank ``j`` when it routes the first ``T`` of its tokens (uniform random top-k, one sample
    per rank, so every token count sees the same routing)."""
    owner = torch.tensor(topo.expert_owner)
    out = torch.empty(topo.num_attention, max_tokens, topo.num_expert, dtype=torch.int32)
    for a in range(topo.num_attention):
        ids, _ = routing(max_tokens, num_experts, top_k, seed=seed * 100_003 + a)
        hit = torch.zeros(max_tokens, topo.num_expert, dtype=torch.int32)
        hit.scatter_(1, owner[ids], 1)  # [T, E] token reaches expert rank
        out[a] = hit.cumsum(0)
    return out


def messages_per_layer(lay: NodeLayout, counts: torch.Tensor, scheme: str) -> dict[str, int]:
    """Messages of one direction by link class (both directions: twice as many)."""
    out = {"intra": 0, "inter": 0}
    for phase in lay.phases(counts, scheme):
        load = phase.load()
        senders = phase.rows.shape[0]
        out["intra"] += int(load[2, :senders].sum())
        out["inter"] += int(load[3, :senders].sum())
    return out


# ---- measured ---------------------------------------------------------------------------------
def _measure_job(rank, world, A, g, hiddens, tokens, args):
    import torch.distributed as dist

    parallel = ParallelConfig(attention_ranks=A, expert_ranks=world - A, ranks_per_node=g)
    topo = Topology.build(rank, parallel, args["num_experts"])
    dtype = resolve_dtype(args["dtype"], args["dtype"], "cpu")
    cpu = torch.device("cpu")
    models = {"auto": CostModel.from_file(args["profile"]) if args["profile"] else CostModel()}
    if args["here_profile"]:
        models["auto@here"] = CostModel.from_file(args["here_profile"])
    times: dict[tuple, list[float]] = {}
    snapshots = {}
    for hidden in hiddens:
        transports = {
            name: TRANSPORTS[name.partition("@")[0]](
                topo,
                dist.group.WORLD,
                cpu,
                hidden,
                args["top_k"],
                dtype,
                cpu,
                **({"cost_model": models[name]} if name in models else {}),
            )
            for name in variants(args["here_profile"])
        }
        for ti, T in enumerate(tokens):
            key = hiddens.index(hidden) * len(tokens) + ti  # the "layer" label of this config
            if topo.is_attention:
                ids, w = routing(T, args["num_experts"], args["top_k"], seed=rank * 7919 + T)
                x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(rank)).to(dtype)
            reps = args["reps"] if T * hidden < 1024 * 7168 else max(2, args["reps"] // 2)
            # Transports take turns within each repetition, so drifts of this (shared) machine
            # hit all of them alike; the first round is a warm-up.
            for rep in range(1 + reps):
                for name, t in transports.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    if topo.is_attention:
                        t.combine(t.dispatch(x, ids, w, layer=key))
                    else:
                        b = t.receive(layer=key)
                        t.send_back(b.x, b)  # identity expert
                    if rep:
                        times.setdefault((hidden, T, name), []).append(time.perf_counter() - t0)
        for name, t in transports.items():
            snapshots[hidden, name] = t.stats_snapshot()
    return times, snapshots


def measure(args) -> list[dict]:
    rows = []
    here = CostModel.from_file(args.here_profile) if args.here_profile else None
    job_args = {
        "num_experts": args.num_experts,
        "top_k": args.top_k,
        "dtype": args.dtype,
        "reps": args.reps,
        "profile": args.profile,
        "here_profile": args.here_profile,
    }
    for text in args.layouts:
        A, E, g = parse_layout(text)
        t0 = time.perf_counter()
        out = run_ranks(
            _measure_job, A + E, A, g, args.hidden, args.tokens, job_args, timeout=1800.0
        )
        print(f"measured {text} in {time.perf_counter() - t0:.0f} s")
        topo = Topology.build(0, ParallelConfig(A, E, ranks_per_node=g), args.num_experts)
        lay = NodeLayout.build(topo)
        elem = torch.empty((), dtype=resolve_dtype(args.dtype, args.dtype, "cpu")).element_size()
        for hi, hidden in enumerate(args.hidden):
            for ti, T in enumerate(args.tokens):
                key = str(hi * len(args.tokens) + ti)
                for name in variants(args.here_profile):
                    reps = zip(*(o[0][hidden, T, name] for o in out))  # per rep, every rank
                    ms = 1e3 * statistics.median(max(r) for r in reps)
                    recs = [o[1][hidden, name]["layers"][key] for o in out]
                    calls = recs[0]["calls"]
                    row = {
                        "layout": text,
                        "hidden": hidden,
                        "tokens_per_rank": T,
                        "transport": name,
                        "ms": round(ms, 3),
                        "scheme": "+".join(s for s, n in recs[0]["schemes"].items() if n),
                    }
                    for c in ("intra", "inter"):
                        msgs = sum(
                            r[d][c]["messages"] for r in recs for d in ("dispatch", "combine")
                        )
                        nbytes = sum(
                            r[d][c]["bytes"] for r in recs for d in ("dispatch", "combine")
                        )
                        row[f"{c}_msgs"] = msgs // calls
                        row[f"{c}_MB"] = round(nbytes / calls / 1e6, 3)
                    if here is not None:
                        counts = torch.zeros(A, E, dtype=torch.int64)
                        owner = torch.tensor(topo.expert_owner)
                        for a in range(A):
                            ids, _ = routing(T, args.num_experts, args.top_k, seed=a * 7919 + T)
                            for j in range(E):
                                counts[a, j] = int((owner[ids] == j).any(dim=1).sum())
                        pred = scheme_times(
                            lay, counts, hidden * elem + 8 * args.top_k, hidden * elem, here
                        )
                        scheme = row["scheme"] if name.startswith("auto") else name
                        row["pred_here_ms"] = round(1e3 * pred.get(scheme, float("nan")), 3)
                    rows.append(row)
    return rows


# ---- predicted --------------------------------------------------------------------------------
def predict(args) -> tuple[list[dict], list[dict]]:
    model = CostModel.from_file(args.profile) if args.profile else CostModel()
    rows, crossings = [], []
    for text in args.predict_layouts:
        A, E, g = parse_layout(text)
        for hidden in args.hidden:
            num_experts, top_k = MODELS.get(hidden, (args.num_experts, args.top_k))
            topo = Topology.build(0, ParallelConfig(A, E, ranks_per_node=g), num_experts)
            lay = NodeLayout.build(topo)
            d_bytes, c_bytes = hidden * 2 + 8 * top_k, hidden * 2  # bf16

            cum = prefix_counts(topo, max(args.predict_tokens), num_experts, top_k)

            def times(T, lay=lay, cum=cum, d=d_bytes, c=c_bytes):
                counts = cum[:, T - 1].to(torch.int64)  # [A, E]
                return counts, scheme_times(lay, counts, d, c, model)

            for T in args.predict_tokens:
                counts, t = times(T)
                msgs = {s: messages_per_layer(lay, counts, s) for s in ("flat", "two_phase")}
                rows.append(
                    {
                        "layout": text,
                        "hidden": hidden,
                        "experts": f"{num_experts}/top{top_k}",
                        "tokens_per_rank": T,
                        "flat_us": round(1e6 * t["flat"], 1),
                        "two_phase_us": round(1e6 * t["two_phase"], 1),
                        "auto": "two_phase" if t["two_phase"] < t["flat"] else "flat",
                        "flat_inter_msgs": msgs["flat"]["inter"],
                        "two_phase_inter_msgs": msgs["two_phase"]["inter"],
                    }
                )
            # every token count 1..max: where does auto change its mind?
            switches, last = [], None
            for T in range(1, max(args.predict_tokens) + 1):
                _, t = times(T)
                choice = "two_phase" if t["two_phase"] < t["flat"] else "flat"
                if choice != last and last is not None:
                    switches.append(f"{T}:{choice}")
                last = choice
            first_flat = next((int(s.split(":")[0]) for s in switches if s.endswith("flat")), None)
            crossings.append(
                {
                    "layout": text,
                    "hidden": hidden,
                    "experts": f"{num_experts}/top{top_k}",
                    "crossover_tokens_per_rank": first_flat,
                    "switches": " ".join(switches),
                }
            )
    return rows, crossings


# ---- output -----------------------------------------------------------------------------------
def write(rows: list[dict], path: Path) -> None:
    if not rows:
        return
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def table(rows: list[dict], title: str) -> None:
    if not rows:
        return
    cols = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print(f"\n## {title}\n")
    print("| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    def ints(s):
        return [int(v) for v in s.split(",")]

    def strs(s):
        return s.split(",")

    ap.add_argument("--layouts", type=strs, default=["4+2:2", "4+2:3"], help="measured, A+E:g")
    ap.add_argument("--tokens", type=ints, default=[1, 16, 256, 4096])
    ap.add_argument("--hidden", type=ints, default=[2048, 4096, 7168])
    ap.add_argument("--num-experts", type=int, default=64, help="measured runs")
    ap.add_argument("--top-k", type=int, default=8, help="measured runs")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", default=None, help="cost model for auto and predictions")
    ap.add_argument("--here-profile", default=None, help="calibrated profile of this machine")
    ap.add_argument("--predict-layouts", type=strs, default=["16+16:8", "32+32:8", "64+64:8"])
    ap.add_argument("--predict-tokens", type=ints, default=[2**i for i in range(13)])
    ap.add_argument("--skip-measure", action="store_true")
    ap.add_argument("--out", default="out/comm")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    predicted, crossings = predict(args)
    write(predicted, out / "predicted.csv")
    write(crossings, out / "crossover.csv")
    model = CostModel.from_file(args.profile) if args.profile else CostModel()
    table(predicted, f"predicted per layer, 8-GPU nodes, bf16, cost model {model.name}")
    table(crossings, "auto: crossover (tokens per attention rank from which flat is chosen)")
    if not args.skip_measure:
        measured = measure(args)
        write(measured, out / "measured.csv")
        table(
            measured,
            f"measured here (gloo, {args.dtype}, {args.num_experts} experts top-{args.top_k})",
        )
    print(f"\nCSV in {out}/")


if __name__ == "__main__":
    main()
