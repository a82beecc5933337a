"""Per-step replica choice (static / local / global) on synthetic routing.

For each scenario (experts, top-k, expert ranks, attention ranks, tokens per attention rank,
routing: uniform, Zipf s, or a hot set that moves between the placement window and the measured
step) it plans a placement with ``--redundant`` replicas per layer from a window of observed
routing (the planner of `splitmoe.eplb.placement`), then reports per policy:

* cost max/mean: the busiest expert rank's ``activate x distinct experts + pairs``
  over the mean (1.0 = perfectly flat); ``static*`` is the no-replica contiguous baseline;
* tokens max/mean: (token, expert) pairs on the busiest rank over the mean;
* decision time (us, median and p99 over ``--reps``, wall clock, one thread): one call of
  `Balancer.choose` for one layer on attention rank 0, as the attention worker makes it (under
  ``torch.inference_mode``): counting its pairs per expert, the load statistics, the replica
  choice. Only the ``global`` policy's count all-gather collective itself is left out: a local
  copy of the same ``[A, E]`` counts stands in for it (the tensor work around it is timed).
  ``cpu us``: the kernel the runtime uses on a CPU rank (the native C kernel,
  `splitmoe.kernels.balance_cpu`); ``ref us``: the PyTorch reference it is tested against
  (``kernel="torch"``), timed alternately in the same process; ``ref/cpu``: their ratio (the C
  kernel is kept on CPU ranks only where it is above 1 on the models' routing). On a GPU, to
  completion (synchronised): ``cuda us`` the Triton kernels the runtime uses there
  (`splitmoe.kernels.balance_triton`), eager; ``graph us`` the same call captured once in a
  CUDA graph and replayed; ``curef us`` the reference's tensor code, eager (the count
  all-gather's buffer on the GPU, as with NCCL).

    python scripts/bench_balancer.py --quick              # the issue's shape only (seconds)
    python scripts/bench_balancer.py                      # the default grid, CPU (+ GPU if any)
    python scripts/bench_balancer.py --experts 256 --ranks 32 --tokens 512 --routing zipf1.0
    python scripts/bench_balancer.py --model realistic    # a real model's routing (below)

``--model default|realistic|PATH``: the routing is the checkpoint's own, not synthetic: its
Hugging Face forward (``output_router_logits``) over random prompts, top-k of each MoE layer's
router logits (experts and top-k from its config; the window and the measured step are disjoint
tokens). One line per (expert ranks, tokens, layer ``--layer``, default the middle MoE layer).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from splitmoe.eplb.balancer import Balancer
from splitmoe.eplb.placement import Placement
from splitmoe.eplb.policy import POLICIES, ExpertCost, ReplicaTable, assign, rank_loads
from splitmoe.models.default_model import resolve_model
from splitmoe.sim.imbalance import route


def popularity(num_experts: int, skew: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** skew
    return (w[torch.randperm(num_experts, generator=g)] / w.sum()).float()


def calibrate_cost(hidden: int, inter: int, device: str, reps: int = 20) -> ExpertCost:
    """a, b of one expert FFN on this device: time(n tokens) ~ a + b n, fitted at n = 1, 129."""
    w13 = torch.randn(2 * inter, hidden, device=device)
    w2 = torch.randn(hidden, inter, device=device)

    def t(n):
        x = torch.randn(n, hidden, device=device)
        samples = []
        for _ in range(reps):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = torch.nn.functional.linear(x, w13)
            torch.nn.functional.linear(torch.nn.functional.silu(h[:, :inter]) * h[:, inter:], w2)
            if device == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    t1, t129 = t(1), t(129)
    b = max((t129 - t1) / 128, 1e-9)
    return ExpertCost(activate=max(1, round((t1 - b) / b)))


def model_routing(path: str, tokens: int, seed: int = 0) -> list[torch.Tensor]:
    """``[tokens, k]`` expert ids per MoE layer: the checkpoint's HF forward over random prompts
    (sequences of 128 tokens), top-k of its router logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    k, vocab = model.config.num_experts_per_tok, model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (-(-tokens // 128), 128), generator=g)
    per_layer: list[list[torch.Tensor]] = []
    with torch.inference_mode():
        for chunk in ids.split(8):
            out = model(input_ids=chunk, output_router_logits=True)
            logits = [x for x in out.router_logits if x is not None]  # [B * 128, E] per layer
            if not per_layer:
                per_layer = [[] for _ in logits]
            for rows, x in zip(per_layer, logits):
                rows.append(torch.topk(x, k, dim=-1).indices)
    return [torch.cat(rows)[:tokens] for rows in per_layer]


def scenario(args, E, R_ranks, T, routing, device, cost, seed=0, pool=None):
    """``pool [N, k]``: a model's routing (the window from its first tokens, the measured step
    from the next), else ``routing`` is synthetic."""
    A, k = args.attention_ranks, args.top_k
    g = torch.Generator().manual_seed(seed)
    if pool is not None:
        window, rest = pool[: A * args.window * T], pool[A * args.window * T :]
        return _rows(args, E, R_ranks, window, list(rest[: A * T].split(T)), cost)
    if routing == "uniform":
        before = after = torch.full((E,), 1.0 / E)
    elif routing.startswith("zipf"):
        before = after = popularity(E, float(routing[4:]), seed)
    else:  # "shift": the hot set of the window differs from the measured step's
        before, after = popularity(E, 1.0, seed), popularity(E, 1.0, seed + 1)
    window = torch.cat([route(T, k, before, g) for _ in range(A * args.window)])
    return _rows(args, E, R_ranks, window, [route(T, k, after, g) for _ in range(A)], cost)


def _rows(args, E, R_ranks, window, ids, cost):
    load = torch.bincount(window.flatten(), minlength=E)
    placement = Placement.initial(E, R_ranks, args.redundant_for(E), (0,)).plan(load[None])
    base = Placement.initial(E, R_ranks, 0, (0,))
    counts = torch.stack([torch.bincount(i.flatten(), minlength=E) for i in ids])
    rows = {}
    for name, pl, policy in [("static*", base, "static")] + [(p, placement, p) for p in POLICIES]:
        table = ReplicaTable.build(pl, 0)
        slots = torch.cat(
            [assign(policy, table, x, a, cost, counts[a], counts) for a, x in enumerate(ids)]
        )
        c, pairs, _ = rank_loads(table, slots, pl.slot_rank, cost)
        rows[name] = {
            "cost": c.max().item() / c.float().mean().item(),
            "tokens": pairs.max().item() / pairs.float().mean().item(),
        }
        if name != "static*":
            rows[name].update(decision_times(policy, pl, ids[0], counts, cost, args.reps))
    return rows


class LocalGather(Balancer):
    """A `Balancer` whose count all-gather copies the given ``[A, E]`` counts in place of the
    collective (everything else `gather_counts` does is kept)."""

    def __init__(self, *args, gathered: torch.Tensor, **kwargs):
        super().__init__(*args, **kwargs)
        self.gathered = gathered.reshape(-1).to(self.comm_device)

    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        self._gathered.copy_(self.gathered)  # stands in for all_gather_single(out, counts)
        rows = self._gathered_rows
        return rows if self._same_device else rows.to(self.device)


def _timer(policy, placement, x, counts, cost, device, kernel, graph=False):
    """One `Balancer.choose` call on attention rank 0 (see the module doc), timed; ``graph``:
    captured once in a CUDA graph, each call a replay."""
    A = counts.shape[0]
    dev = torch.device(device)
    balancer = LocalGather(
        policy, placement, 0, A, cost, dev, gathered=counts, kernel=kernel,
        comm_device=dev if device == "cuda" else None,
    )  # fmt: skip
    x = x.to(device)
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # compile and warm up outside the capture
                balancer.choose(0, x)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            balancer.choose(0, x)

        def replay() -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            g.replay()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) * 1e6

        return replay

    def once() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        balancer.choose(0, x)
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e6

    return once


def _summary(samples: list[float], name: str) -> dict:
    samples = sorted(samples)
    median, p99 = samples[len(samples) // 2], samples[-len(samples) // 100 - 1]
    return {f"{name}_us": median, f"{name}_p99": p99}


def decision_times(policy, placement, x, counts, cost, reps, device="cpu"):
    """Median and p99 (us) of `Balancer.choose` with the kernel the runtime uses on ``device``
    and, on the CPU, with the PyTorch reference, the two alternated call by call."""
    if device == "cpu":
        kernels = {"cpu": ("auto", False), "ref": ("torch", False)}
    else:  # the Triton kernels ("auto" on CUDA) eager and replayed, the reference eager
        kernels = {"cuda": ("auto", False), "graph": ("auto", True), "curef": ("torch", False)}
    timers = {
        k: _timer(policy, placement, x, counts, cost, device, kernel, graph)
        for k, (kernel, graph) in kernels.items()
    }
    samples = {k: [] for k in kernels}
    with torch.inference_mode():
        for i in range(reps + 20):
            for k, once in timers.items():
                t = once()
                if i >= 20:  # warm-up
                    samples[k].append(t)
    out = {}
    for k, s in samples.items():
        out.update(_summary(s, k))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--experts", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--ranks", type=int, nargs="+", help="expert ranks (8 32 64; --model: 2 4)")
    ap.add_argument("--tokens", type=int, nargs="+", help="per attention rank (16 512 4096; "
                    "--model: 16 64 256)")  # fmt: skip
    ap.add_argument(
        "--routing", nargs="+", default=["uniform", "zipf0.5", "zipf1.0", "zipf1.5", "shift"]
    )
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--attention-ranks", type=int, default=4)
    ap.add_argument("--redundant", type=int, default=None, help="replicas per layer (E/8)")
    ap.add_argument("--window", type=int, default=4, help="steps of load the placement sees")
    ap.add_argument(
        "--activate",
        type=int,
        default=None,
        help="cost of one expert activation in tokens (default: calibrated on this "
        "machine for a 4096 x 1536 expert)",
    )
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument(
        "--model",
        default=None,
        help="default | realistic | PATH: the checkpoint's own routing (see above); ranks and "
        "tokens default to 2 4 and 16 64 256",
    )
    ap.add_argument("--layer", type=int, default=None, help="--model: which MoE layer (middle)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the issue's shape only: 256 experts, 32 expert ranks, 512 tokens, Zipf 1.0",
    )
    args = ap.parse_args()
    if args.quick:
        args.experts, args.ranks, args.tokens, args.routing = [256], [32], [512], ["zipf1.0"]
    args.redundant_for = lambda E: E // 8 if args.redundant is None else args.redundant
    pools = {}
    model = args.model is not None
    args.ranks = args.ranks or ([2, 4] if model else [8, 32, 64])
    args.tokens = args.tokens or ([16, 64, 256] if model else [16, 512, 4096])
    if model:
        path = resolve_model(args.model)
        need = args.attention_ranks * (args.window + 1) * max(args.tokens)
        layers = model_routing(path, need)
        layer = len(layers) // 2 if args.layer is None else args.layer
        pool = layers[layer]  # [need, k]
        args.top_k = pool.shape[1]
        args.experts = [json.loads((Path(path) / "config.json").read_text())["num_experts"]]
        args.routing = [f"L{layer}"]
        print(f"routing: {path}, MoE layer {layer} of {len(layers)}")
        pools[args.routing[0]] = pool
    torch.set_num_threads(1)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    columns = ["cpu", "ref"] + (["cuda", "graph", "curef"] if "cuda" in devices else [])
    cost = (
        ExpertCost(activate=args.activate)
        if args.activate
        else calibrate_cost(4096, 1536, devices[-1])
    )
    source = "given" if args.activate else f"{devices[-1]} calibration"
    print(
        f"cost: activate={cost.activate} x token ({source}); "
        f"{args.attention_ranks} attention ranks, top-{args.top_k}"
    )
    head = f"{'E':>4} {'ranks':>5} {'T':>5} {'routing':>8} {'policy':>8} {'cost':>6} {'tok':>6}"
    head += "".join(f" {d + ' us':>9} {'p99':>7}" for d in columns) + f" {'ref/cpu':>7}"
    print(head)
    for E, R, T, routing in itertools.product(args.experts, args.ranks, args.tokens, args.routing):
        if R > E:
            continue
        rows = scenario(args, E, R, T, routing, "cpu", cost, pool=pools.get(routing))
        if "cuda" in devices:
            for p in POLICIES:
                pl = Placement.initial(E, R, args.redundant_for(E), (0,))
                x = route(T, args.top_k, torch.full((E,), 1.0 / E), torch.Generator())
                counts = torch.bincount(x.flatten(), minlength=E)[None].repeat(
                    args.attention_ranks, 1
                )
                rows[p].update(decision_times(p, pl, x, counts, cost, args.reps, "cuda"))
        for name, r in rows.items():
            line = (
                f"{E:>4} {R:>5} {T:>5} {routing:>8} {name:>8} {r['cost']:>6.3f} {r['tokens']:>6.3f}"
            )
            for d in columns:
                if f"{d}_us" in r:
                    line += f" {r[f'{d}_us']:>9.1f} {r[f'{d}_p99']:>7.1f}"
            if "cpu_us" in r:
                line += f" {r['ref_us'] / r['cpu_us']:>7.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
