"""Does a model fit a layout of ranks? Each rank's bytes, before any weight is read.

    python -m splitmoe.plan_memory --model CONFIG.json --attention-ranks A --expert-ranks E \\
        --gpu-memory-gb G
    python -m splitmoe.plan_memory --model deepseek-v3 --gpus 8 --gpu-memory-gb 141

``--model``: a ``config.json``, a checkpoint directory, or a config shipped under
``splitmoe/sim/configs/``. Without ``--attention-ranks`` / ``--expert-ranks`` the tool proposes
them for ``--gpus`` GPUs: the fewest expert ranks whose experts fit, the rest attention ranks
(each holds its own KV cache, so the more the better once the experts fit). Prints the per-rank
table (`splitmoe.memory.rank_memory`, the one memory model the runtime and the simulator use)
and exits 1 with a line saying what does not fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from splitmoe.memory import MemoryTable, ModelDims, rank_memory

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def model_dims(model: str) -> ModelDims:
    """`ModelDims` of a ``config.json``, a checkpoint directory or a shipped config's name: read
    by the runtime's family adapter where it runs the family, else by the simulator's parser."""
    from splitmoe.sim.model import CONFIG_DIR, ModelShape

    p = Path(model)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file() and (CONFIG_DIR / f"{model}.json").is_file():
        p = CONFIG_DIR / f"{model}.json"
    if p.is_file():
        from splitmoe.models.config import ModelConfig
        from splitmoe.models.families import FAMILIES, family_for

        raw = json.loads(p.read_text())
        if raw.get("model_type") in FAMILIES:
            fields = family_for(raw["model_type"], p).parse_config(raw, p)
            name = p.stem if p.name != "config.json" else p.parent.name
            return ModelDims.from_config(ModelConfig(path=name, **fields))
    return ModelShape.from_config(model).memory_dims()


def plan(
    dims: ModelDims,
    attention_ranks: int,
    expert_ranks: int,
    gpu_memory_gb: float,
    *,
    dtype_bytes: int = 2,
    kv_tokens: int = 65536,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
    memory_fraction: float = 0.9,
    redundant_experts: int = 0,
) -> MemoryTable:
    """The per-rank table of one layout, each rank against ``memory_fraction`` of its GPU."""
    return rank_memory(
        dims,
        attention_ranks,
        expert_ranks,
        dtype_bytes=dtype_bytes,
        kv_tokens=kv_tokens,
        window_tokens=min(kv_tokens, max_num_seqs * dims.sliding_window),
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        redundant_experts=redundant_experts,
        capacity=int(gpu_memory_gb * 1e9 * memory_fraction),
    )


def propose(dims: ModelDims, gpus: int, gpu_memory_gb: float, **kw) -> MemoryTable:
    """The layout of ``gpus`` ranks with the fewest expert ranks that fits (then the most
    attention ranks, hence KV caches); the table of the fullest split tried when none fits."""
    if gpus < 1:
        raise ValueError(f"--gpus={gpus} must be >= 1")
    table = plan(dims, gpus, 0, gpu_memory_gb, **kw)  # colocated: all GPUs attention ranks
    if table.fits:
        return table
    for e in range(1, gpus):
        if e > dims.num_experts + kw.get("redundant_experts", 0):
            break
        table = plan(dims, gpus - e, e, gpu_memory_gb, **kw)
        if table.fits:
            return table
    return table


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m splitmoe.plan_memory",
        description="Each rank's memory for a model and a layout; exits 1 when it does not fit.",
    )
    ap.add_argument(
        "--model",
        required=True,
        help="config.json, checkpoint directory, or a shipped config's name",
    )
    ap.add_argument("--attention-ranks", type=int, help="attention ranks (with --expert-ranks)")
    ap.add_argument("--expert-ranks", type=int, help="expert ranks (0: colocated)")
    ap.add_argument(
        "--gpus", type=int, help="propose attention and expert ranks for this many GPUs"
    )
    ap.add_argument("--gpu-memory-gb", type=float, required=True, help="memory of one GPU, GB")
    ap.add_argument(
        "--memory-fraction",
        type=float,
        default=0.9,
        help="share of a GPU's memory a rank may use (default 0.9)",
    )
    ap.add_argument(
        "--dtype",
        choices=sorted(DTYPE_BYTES),
        default="bfloat16",
        help="run dtype of unquantized weights, activations and the KV cache",
    )
    ap.add_argument(
        "--dequantized",
        action="store_true",
        help="size the weights dequantized to --dtype (a bf16 copy of an FP8 or "
        "MXFP4 release), not as released",
    )
    ap.add_argument(
        "--kv-tokens",
        type=int,
        default=65536,
        help="tokens each attention rank caches (default 65536)",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--redundant-experts", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    given = (args.attention_ranks is not None, args.expert_ranks is not None)
    if given[0] != given[1] or (all(given) == (args.gpus is not None)):
        ap.error("give --attention-ranks and --expert-ranks, or --gpus for a proposal")
    if not 0 < args.memory_fraction <= 1:
        ap.error("--memory-fraction must be in (0, 1]")
    if not args.gpu_memory_gb > 0:
        ap.error("--gpu-memory-gb must be > 0")
    for name in ("kv_tokens", "max_num_batched_tokens", "max_num_seqs", "redundant_experts"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    try:
        dims = model_dims(args.model)
    except (OSError, ValueError) as e:
        print(f"plan_memory: {e}", file=sys.stderr)
        return 2
    if args.dequantized:
        dims = dims.dequantized()
    kw = dict(
        dtype_bytes=DTYPE_BYTES[args.dtype],
        kv_tokens=args.kv_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        memory_fraction=args.memory_fraction,
        redundant_experts=args.redundant_experts,
    )
    try:
        if args.gpus is not None:
            table = propose(dims, args.gpus, args.gpu_memory_gb, **kw)
        else:
            table = plan(dims, args.attention_ranks, args.expert_ranks, args.gpu_memory_gb, **kw)
    except ValueError as e:
        print(f"plan_memory: {e}", file=sys.stderr)
        return 2
    A = len(table.role("attention"))
    E = len(table.role("expert"))
    print(table)
    where = f"{A} attention + {E} expert ranks of {args.gpu_memory_gb:g} GB"
    if table.fits:
        print(f"fits: {where} ({args.kv_tokens} KV tokens per attention rank)")
        return 0
    worst = max(table.failures(), key=lambda r: r.total)
    print(
        f"does not fit: {where}: rank {worst.rank} ({worst.role}) needs "
        f"{worst.total / 1e9:.1f} GB of {worst.capacity / 1e9:.1f} GB usable"
        + (" (no split of --gpus fits)" if args.gpus is not None else ""),
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
