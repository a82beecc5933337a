"""A:E planner: the best disaggregated deployments of a model on a GPU budget under a TPOT target.

    python scripts/plan.py --reproduce                 # published AF / EP results, simulated
    python scripts/plan.py --reproduce --sensitivity   # ... and each hardware constant x0.5, x2
    python scripts/plan.py --model qwen3-235b-a22b --hardware h100 --gpus 64 --tpot-slo 50ms
    python scripts/plan.py --model deepseek-v3 --hardware h800 --gpus 64 --tpot-slo 50ms \\
        --verdict --crossover bandwidth=0.25,0.5,1,2,4,8 --plot out/plan
    python scripts/plan.py --verdict-matrix            # AF vs colocated: 3 models x 4 GPUs
    python scripts/plan.py --model path/to/config.json --hardware h200 --gpus 32 --tpot-slo 30ms \\
        --context 8192 --skew 0.5
    python scripts/plan.py --model qwen3-235b-a22b --gpus 64 --tpot-slo 50ms --pd --ttft-slo 1.5s \\
        --prompt-len 2048 --output-len 256 --transfer-bandwidth 25   # PD + AF vs one pool

``--reproduce`` exits 1 when a counted case misses (see `splitmoe.sim.reproduce`).

``--model``: a ``config.json`` (any supported family, DeepSeek-V2/V3, Step-3, or any MoE config
with the common Hugging Face keys), a checkpoint directory, or a shipped config name
(``splitmoe/sim/configs/``). ``--hardware``: a profile name (``splitmoe/sim/profiles/``: h100,
h800, h200, a100, h20, l40s, gb200, cpu) or a profile JSON; ``--expert-hardware`` puts the expert
ranks on another GPU (heterogeneous AF). Prints the best plans (attention:expert ranks,
micro-batches, transport, balancer, replicas, batch per attention rank) with their predicted
TPOT, throughput per GPU and per-layer times, beside the best colocated deployment (experts
sharded over the same GPUs, attention data-parallel). Per-layer columns are milliseconds per
MoE layer for a whole step (all micro-batches); ``ovlp`` is the share of the serial time hidden
by the ping-pong overlap.

``--verdict``: whether AF beats colocated under the target and what binds each side;
``--verdict-matrix``: that verdict for DeepSeek-V3 (fine experts), Qwen3-235B and
Mixtral-8x22B (coarse) on H100, H200, H800 and GB200 (``--gpus``, default 64; ``--tpot-slo``,
default 50 ms; ``--context``), with AF / colocated as the NIC's bandwidth is halved and doubled
and against a colocated baseline held to EP4, EP16 and EP64 (a few minutes);
``--crossover PARAM=v1,v2,...``: that verdict as ``bandwidth`` (network bytes/s scale),
``context`` (mean tokens) or ``sparsity`` (top-k / experts at the same expert parameters) varies;
``--plot DIR``: throughput per GPU against TPOT (Pareto fronts, AF and colocated), the A:E ratio
sweep with the closed-form ratio, and the crossover.

``--pd``: prefill-decode disaggregation (`splitmoe.sim.pd`): prefill instances (colocated EP)
beside AF decode instances, against one AF pool and one colocated pool running prefill and
decode together (chunked prefill), at ``--ttft-slo`` and ``--tpot-slo`` (``--tpot-p99``: the
target bounds a step that carries a prompt chunk, not the mean) for prompts of ``--prompt-len``
tokens generating ``--output-len``; ``--transfer-bandwidth`` GB/s: the KV link (default: the
profile's network); ``--max-num-batched-tokens``: an attention rank's tokens per step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from splitmoe.sim.hardware import load_profile
from splitmoe.sim.model import ModelShape
from splitmoe.sim.planner import (
    CROSSOVER_PARAMS,
    CompareSpace,
    SearchSpace,
    ae_ratio_sweep,
    af_deployments,
    binding,
    closed_form_ratio,
    colocated_deployments,
    crossover,
    pareto_front,
    search,
    sweep_points,
    table,
    verdict,
)
from splitmoe.sim.simulator import Simulator


def seconds(text: str) -> float:
    """``50ms``, ``0.05s``, ``0.05`` -> seconds."""
    t = text.strip().lower()
    if t.endswith("ms"):
        return float(t[:-2]) / 1e3
    if t.endswith("s"):
        return float(t[:-1])
    return float(t)


def crossover_arg(text: str) -> tuple[str, list[float]]:
    name, _, values = text.partition("=")
    if name not in CROSSOVER_PARAMS or not values:
        raise argparse.ArgumentTypeError(
            f"--crossover {text!r}: use PARAM=v1,v2,... with PARAM one of {CROSSOVER_PARAMS}"
        )
    return name, [float(v) for v in values.split(",")]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reproduce", action="store_true",
                    help="simulate the published deployments in splitmoe/sim/cases/")  # fmt: skip
    ap.add_argument("--sensitivity", action="store_true",
                    help="with --reproduce: each hardware constant x0.5 and x2")  # fmt: skip
    ap.add_argument("--verdict-matrix", action="store_true",
                    help="AF vs colocated for three models on four GPUs")  # fmt: skip
    ap.add_argument("--model")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--expert-hardware", default=None, help="expert ranks' GPU (heterogeneous)")
    ap.add_argument("--profile", default=None, metavar="FRAGMENT",
                    help="constants measured on a GPU of the --hardware kind "
                         "(scripts/bench_kernels.py --profile-fragment)")  # fmt: skip
    ap.add_argument("--gpus", type=int)
    ap.add_argument("--tpot-slo", type=seconds, help="e.g. 50ms")
    ap.add_argument("--context", type=float, default=4096, help="mean KV tokens per sequence")
    ap.add_argument("--skew", type=float, default=0.3, help="routing skew (Zipf exponent)")
    ap.add_argument("--kv-bytes", type=int, default=2, help="bytes per KV element (1: FP8)")
    ap.add_argument("--top", type=int, default=8, help="plans to print")
    ap.add_argument("--quick", action="store_true", help="a smaller search space")
    ap.add_argument("--verdict", action="store_true", help="does AF beat colocated, and why")
    ap.add_argument("--crossover", type=crossover_arg, default=None, metavar="PARAM=v1,v2,...")
    ap.add_argument("--plot", default=None, metavar="DIR", help="write the planner's figures")
    ap.add_argument("--pd", action="store_true", help="PD + AF against one pool (TTFT, TPOT)")
    ap.add_argument("--ttft-slo", type=seconds, default=2.0, help="--pd: e.g. 1500ms")
    ap.add_argument("--tpot-p99", action="store_true", help="--pd: bound the p99 TPOT")
    ap.add_argument("--prompt-len", type=int, default=2048, help="--pd: prompt tokens")
    ap.add_argument("--output-len", type=int, default=256, help="--pd: output tokens")
    ap.add_argument("--transfer-bandwidth", type=float, default=None, metavar="GB/s",
                    help="--pd: the KV link (default: the profile's network link)")  # fmt: skip
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="--pd: an attention rank's tokens per step")  # fmt: skip
    args = ap.parse_args(argv)
    if args.sensitivity and not args.reproduce:
        ap.error("--sensitivity goes with --reproduce")
    if args.verdict_matrix:
        return args
    if not args.reproduce and not (args.model and args.gpus and args.tpot_slo):
        ap.error("--model, --gpus and --tpot-slo are required (or --reproduce)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.reproduce:
        from splitmoe.sim.reproduce import count, reproduce, sensitivity, sensitivity_table
        from splitmoe.sim.reproduce import table as reproduce_table

        rows = reproduce()
        print(reproduce_table(rows))
        if args.sensitivity:
            print()
            print(sensitivity_table(*sensitivity()))
        c = count(rows)
        return 0 if c.cases_within == c.cases else 1
    if args.verdict_matrix:
        from splitmoe.sim.planner import matrix_table, verdict_matrix

        gpus, slo = args.gpus or 64, args.tpot_slo or 0.05
        print(f"{gpus} GPUs, TPOT <= {slo * 1e3:.0f} ms, mean context {args.context:.0f}, routing "
              f"skew {args.skew}; tok/s per GPU; AF/co: best AF over best colocated")  # fmt: skip
        print(matrix_table(verdict_matrix(gpus=gpus, tpot_slo=slo, context=args.context,
                                          skew=args.skew)))  # fmt: skip
        return 0
    model = ModelShape.from_config(args.model)
    hw = load_profile(args.hardware)
    ehw = load_profile(args.expert_hardware) if args.expert_hardware else None
    if args.profile:
        from splitmoe.sim.calibrate import apply_kernel_fragment

        fragment = json.loads(Path(args.profile).read_text())
        hw = apply_kernel_fragment(hw, fragment)
    sim = Simulator(model, hw, skew=args.skew, expert_hw=ehw, kv_bytes=args.kv_bytes)
    print(model.describe())
    print(
        f"{hw.name}: {hw.description}"
        + (f"\nexpert ranks on {ehw.name}: {ehw.description}" if ehw else "")
        + f"\n{args.gpus} GPUs, TPOT <= {args.tpot_slo * 1e3:.0f} ms, mean context "
        f"{args.context:.0f} tokens, routing skew {args.skew}\n"
    )
    if args.pd:
        return explain_pd(sim, args)
    if args.verdict or args.crossover or args.plot:
        return explain(sim, args)
    space = SearchSpace()
    if args.quick:
        space = SearchSpace(
            attention_ranks=(2, 4, 8, 16, 32),
            expert_ranks=(2, 4, 8, 16),
            micro_batches=(1, 2, 3),
            transports=("flat", "auto", "gpu_a2a"),
            balancers=(("static", 0), ("global", 1)),
            colocated_sizes=(8, 16, 32, 64),
        )
    t0 = time.time()
    disagg, colocated = search(sim, args.gpus, args.tpot_slo, args.context, space)
    print(f"{len(disagg) + len(colocated)} feasible plans in {time.time() - t0:.1f} s\n")
    if not disagg and not colocated:
        print("no deployment meets the TPOT target within memory: relax --tpot-slo or add GPUs")
        return 1
    print(table(disagg, "disaggregated (A:E per instance)", args.top))
    print()
    print(table(colocated, "colocated baseline (EP over instance)", 3))
    if disagg and colocated:
        gain = disagg[0].per_gpu / colocated[0].per_gpu
        print(f"\nbest disaggregated / best colocated throughput per GPU: {gain:.2f}x")
    return 0


def explain_pd(sim: Simulator, args) -> int:
    """--pd: the best PD + AF, AF and colocated plans at the TTFT and TPOT targets."""
    from splitmoe.sim.pd import Workload, compare
    from splitmoe.sim.pd import table as pd_table

    wl = Workload(
        args.prompt_len, args.output_len, args.ttft_slo, args.tpot_slo,
        args.max_num_batched_tokens, "p99" if args.tpot_p99 else "mean",
    )  # fmt: skip
    bw = args.transfer_bandwidth * 1e9 if args.transfer_bandwidth else None
    link = bw or sim.hw.links.inter.bytes_per_s
    print(
        f"PD: prompts of {wl.prompt_len} tokens, {wl.output_len} out; TTFT <= "
        f"{wl.ttft_slo * 1e3:.0f} ms, {wl.tpot_of} TPOT <= {wl.tpot_slo * 1e3:.0f} ms; KV link "
        f"{link / 1e9:.0f} GB/s\n"
    )
    v = compare(sim, args.gpus, wl, bandwidth=bw)
    print(v.text())
    print()
    print(pd_table(v.plans, args.top))
    return 0 if v.plans else 1


def explain(sim: Simulator, args) -> int:
    """--verdict / --crossover / --plot: the small comparison space (GPU-initiated all-to-all,
    ping-pong micro-batches; colocated EP with two micro-batches)."""
    space = CompareSpace()
    v = verdict(sim, args.gpus, args.tpot_slo, args.context, space)
    print(v.text(sim))
    sweep = None
    if args.crossover:
        param, values = args.crossover
        sweep = crossover(sim, param, values, args.gpus, args.tpot_slo, args.context, space)
        print(f"\nAF / colocated as {param} varies:")
        print(f"{param:>10}{'AF tok/s/GPU':>14}{'colocated':>11}{'AF/coloc':>10}  AF bound by"
              "          colocated bound by")  # fmt: skip
        for value, vd in sweep:
            af = vd.af.per_gpu if vd.af else 0.0
            co = vd.colocated.per_gpu if vd.colocated else 0.0
            ab = binding(sim, vd.af.prediction) if vd.af else "-"
            cb = binding(sim, vd.colocated.prediction) if vd.colocated else "-"
            print(f"{value:>10g}{af:>14.0f}{co:>11.0f}{vd.gain:>10.2f}  {ab:<20} {cb}")
    if args.plot:
        for p in plot(sim, args, space, v, sweep):
            print(f"plot: {p}")
    return 0


def plot(sim: Simulator, args, space: CompareSpace, v, sweep) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.plot)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{sim.model.name} on {sim.hw.name}"
    paths = []

    def save(fig, ax, path: Path) -> Path:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    # 1. throughput per GPU against TPOT: every AF and colocated point, and their fronts
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for label, deps, color in (
        ("AF", af_deployments(sim, args.gpus, space), "tab:blue"),
        ("colocated EP", colocated_deployments(args.gpus, space), "tab:orange"),
    ):
        pts = sweep_points(sim, deps, args.context, space.batches)
        ax.scatter([p.tpot * 1e3 for p in pts], [p.tokens_per_s_per_gpu for p in pts], s=6,
                   alpha=0.25, color=color)  # fmt: skip
        front = pareto_front(pts)
        ax.plot([p.tpot * 1e3 for p in front], [p.tokens_per_s_per_gpu for p in front],
                marker="o", ms=3, color=color, label=f"{label} Pareto front")  # fmt: skip
    ax.axvline(args.tpot_slo * 1e3, color="k", ls="--", lw=0.8, label="TPOT target")
    ax.set_xlim(0, args.tpot_slo * 1e3 * 3)
    ax.set_xlabel("TPOT, ms")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(f"{name}: throughput vs latency ({args.gpus} GPUs, context {args.context:.0f})")
    paths.append(save(fig, ax, out / "pareto.png"))
    # 2. A:E ratio sweep at a fixed E, with the closed-form ratio
    # at the best AF plan's E and micro-batches (the verdict's), A from E/4 to 4E
    e, m = min(16, sim.model.num_experts), 2
    if v.af:
        e, m = v.af.prediction.deployment.expert_ranks, v.af.prediction.deployment.micro_batches
    attn = sorted({max(1, round(e * r)) for r in (0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3, 4)})
    rs = ae_ratio_sweep(sim, e, attn, args.tpot_slo, args.context, m, batches=space.batches)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ok = [(a, p) for a, p in rs if p is not None]
    ax.plot(
        [a / e for a, _ in ok], [p.per_gpu for _, p in ok], marker="o", label=f"E = {e}, m = {m}"
    )
    if ok:
        best = max(ok, key=lambda ap: ap[1].per_gpu)[1].prediction
        r = closed_form_ratio(sim, e, best.batch, args.context, m)
        ax.axvline(r, color="tab:red", ls="--", lw=1,
                   label=f"closed form {r:.2f} (batch {best.batch})")  # fmt: skip
    ax.set_xlabel("A : E")
    ax.set_ylabel("output tokens/s per GPU (best batch under the target)")
    ax.set_title(f"{name}: attention-to-expert ratio")
    paths.append(save(fig, ax, out / "ae_ratio.png"))
    # 3. the crossover
    if sweep:
        param = args.crossover[0]
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        xs = [x for x, _ in sweep]
        ax.plot(xs, [vd.af.per_gpu if vd.af else 0 for _, vd in sweep], marker="o", label="AF")
        ax.plot(xs, [vd.colocated.per_gpu if vd.colocated else 0 for _, vd in sweep], marker="s",
                label="colocated EP")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel({"bandwidth": "network bandwidth (x profile)", "context": "mean context",
                       "sparsity": "top-k / experts (same expert parameters)"}[param])  # fmt: skip
        ax.set_ylabel("output tokens/s per GPU under the target")
        ax.set_title(f"{name}: AF vs colocated as {param} varies")
        paths.append(save(fig, ax, out / f"crossover_{param}.png"))
    return paths


if __name__ == "__main__":
    sys.exit(main())
