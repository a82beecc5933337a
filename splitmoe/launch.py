"""Batch generation under torchrun or mpirun: ``python -m splitmoe.launch``.

```
torchrun --nproc-per-node 3 -m splitmoe.launch --model CKPT --attention-ranks 1 \\
         --prompts prompts.jsonl --output out.jsonl
mpirun -n 3 python -m splitmoe.launch --model CKPT --attention-ranks 1 ...
```

Ranks ``0..A-1`` are attention ranks; the rest of the world are expert ranks (none: colocated).
Input lines are ``{"prompt": "..."}`` or ``{"prompt_token_ids": [...]}``, with optional sampling
fields (``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop_token_ids``,
``ignore_eos``) and an optional ``id`` echoed back. Every rank reads and checks the whole file
before the job starts, so bad input fails everywhere at once; requests are assigned to attention
ranks by the same deterministic least-load rule on every rank; rank 0 writes one output line per
input line, in input order.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from splitmoe.comm.distributed import shutdown_groups
from splitmoe.engine.channel import Channel, Inbox
from splitmoe.inputs import check_request
from splitmoe.metrics import StepRecord, summarize
from splitmoe.models.loader import CheckpointReader
from splitmoe.options import add_engine_args, engine_args, engine_config
from splitmoe.outputs import RequestOutput
from splitmoe.runtime import run_rank
from splitmoe.sampling_params import SamplingParams
from splitmoe.scheduler.request import RequestSpec
from splitmoe.scheduler.router import LeastLoadRouter
from splitmoe.tokenizer import Tokenizer

logger = logging.getLogger("splitmoe")


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str  # "torchrun" | "mpi" | "single"


def detect_env() -> LaunchEnv:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        world = int(env["WORLD_SIZE"])
        return LaunchEnv(
            int(env["RANK"]),
            world,
            int(env.get("LOCAL_RANK", env["RANK"])),
            int(env.get("LOCAL_WORLD_SIZE", world)),
            "torchrun",
        )
    for rank_key, size_key, lrank_key, lsize_key in (
        (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    ):
        if rank_key in env and size_key in env:
            world = int(env[size_key])
            return LaunchEnv(
                int(env[rank_key]),
                world,
                int(env.get(lrank_key, env[rank_key])),
                int(env.get(lsize_key, world)),
                "mpi",
            )
    return LaunchEnv(0, 1, 0, 1, "single")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rendezvous(env: LaunchEnv) -> str:
    """torchrun provides MASTER_ADDR/PORT; under MPI rank 0 picks an address and a free port and
    broadcasts them over MPI."""
    if env.launcher == "torchrun":
        return "env://"
    if env.launcher == "single":
        return f"tcp://127.0.0.1:{_free_port()}"
    try:
        from mpi4py import MPI
    except ImportError:
        raise SystemExit(
            "splitmoe.launch: started by mpirun, but mpi4py is missing: pip install 'splitmoe[mpi]'"
        ) from None
    addr = None
    if env.rank == 0:
        host = os.environ.get("MASTER_ADDR") or (
            "127.0.0.1"
            if env.local_world_size == env.world_size
            else socket.gethostbyname(socket.gethostname())
        )
        port = int(os.environ.get("MASTER_PORT") or _free_port())
        addr = f"tcp://{host}:{port}"
    return MPI.COMM_WORLD.bcast(addr, root=0)


_SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)


def read_prompts(
    path: Path, defaults: SamplingParams, tokenizer: Tokenizer | None
) -> list[tuple[object, list[int], SamplingParams]]:
    """Parses the JSONL input; every problem names its line."""
    if not path.is_file():
        raise ValueError(f"prompts file {str(path)!r} does not exist")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}: "
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}not valid JSON ({e.msg})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{where}each line must be a JSON object")
        unknown = set(item) - _SAMPLING_FIELDS - {"prompt", "prompt_token_ids", "id"}
        if unknown:
            raise ValueError(f"{where}unknown field(s) {sorted(unknown)}")
        if ("prompt" in item) == ("prompt_token_ids" in item):
            raise ValueError(f"{where}give exactly one of 'prompt' or 'prompt_token_ids'")
        if "prompt" in item:
            if not isinstance(item["prompt"], str):
                raise ValueError(f"{where}'prompt' must be a string")
            if tokenizer is None:
                raise ValueError(f"{where}text prompt, but the model has no tokenizer.json")
            if not item["prompt"]:
                raise ValueError(f"{where}the prompt is empty")
            ids = tokenizer.encode(item["prompt"])
        else:
            ids = item["prompt_token_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError(f"{where}'prompt_token_ids' must be a list of integers")
        overrides = {k: v for k, v in item.items() if k in _SAMPLING_FIELDS}
        try:
            params = SamplingParams.from_dict({**defaults.__dict__, **overrides})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}{e}") from None
        out.append((item.get("id"), ids, params))
    if not out:
        raise ValueError(f"prompts file {path} has no prompts")
    return out


class _StaticChannel(Channel):
    """An attention rank's share of the input file; collects its finished outputs."""

    closed = True

    def __init__(self, specs: list[RequestSpec]):
        self._specs = specs
        self.outputs: dict[int, RequestOutput] = {}
        self.steps: list[StepRecord] = []
        self.start = 0.0
        self._prompts = {s.request_id: s.prompt_token_ids for s in specs}

    def poll(self, timeout) -> Inbox:
        specs, self._specs = self._specs, []
        now = time.time()  # requests arrive when the rank is ready to take them
        self.start = self.start or now
        for s in specs:
            s.arrival_time = now
        return Inbox(requests=specs)

    def emit(self, updates, record):
        self.steps.append(record)
        for u in updates:
            out = self.outputs.setdefault(
                u.request_id,
                RequestOutput(
                    request_id=u.request_id, prompt_token_ids=self._prompts[u.request_id]
                ),
            )
            out.token_ids.extend(u.new_token_ids)
            if u.finish_reason is not None:
                out.finish_reason = u.finish_reason
                out.metrics = u.metrics


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m splitmoe.launch", description="AF-disaggregated MoE batch generation"
    )
    ap.add_argument("--model", required=True, help="HF checkpoint directory")
    ap.add_argument("--prompts", required=True, type=Path, help="input JSONL")
    ap.add_argument("--output", required=True, type=Path, help="output JSONL (written by rank 0)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None, help="default per-request sampling seed")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--metrics", action="store_true", help="print serving metrics at the end")
    ap.add_argument("-v", "--verbose", action="store_true")
    # every engine option; the expert ranks are the rest of the world
    add_engine_args(ap, exclude=("expert_ranks",))
    return ap


def prepare(args, env: LaunchEnv):
    """Everything that can fail on bad input, done on every rank before any rank joins the job."""
    options = engine_args(args)
    attention_ranks = options.get("attention_ranks", 1)
    if not isinstance(attention_ranks, int) or attention_ranks > env.world_size:
        raise ValueError(
            f"--attention-ranks {attention_ranks} exceeds the world size {env.world_size}; "
            "start at least that many processes"
        )
    options["expert_ranks"] = env.world_size - attention_ranks
    cfg = engine_config(args.model, **options)
    CheckpointReader(args.model)
    tokenizer = Tokenizer.from_checkpoint(args.model)
    defaults = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    items = read_prompts(args.prompts, defaults, tokenizer)
    for i, (_, ids, params) in enumerate(items):
        try:
            check_request(i, ids, params, cfg)
        except ValueError as e:
            raise ValueError(f"{args.prompts}: request {i}: {e}") from None
    return cfg, tokenizer, items


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = detect_env()
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format=f"[rank {env.rank}] %(levelname)s %(message)s",
    )
    try:
        cfg, tokenizer, items = prepare(args, env)
    except (ValueError, TypeError, OSError, ImportError) as e:
        print(f"splitmoe.launch: error: {e}", file=sys.stderr)
        return 2
    init_method = rendezvous(env)
    router = LeastLoadRouter(cfg.parallel.attention_ranks)
    mine = []
    for rid, (_, ids, params) in enumerate(items):
        if router.pick(len(ids) + params.max_tokens) == env.rank:
            mine.append(RequestSpec(rid, ids, params, arrival_time=0.0))
    channel = _StaticChannel(mine)
    role = "attention" if env.rank < cfg.parallel.attention_ranks else "expert"
    try:
        ctx = run_rank(cfg, env.rank, init_method, channel, env.local_rank, env.local_world_size)
    except Exception as e:
        # A broken connection here usually means a peer rank died; the launcher (torchrun,
        # mpirun) names the rank that exited first and stops the rest.
        print(
            f"splitmoe.launch: rank {env.rank} ({role}) failed: {type(e).__name__}: {e}",
            file=sys.stderr,
        )
        return 1
    elapsed = time.time() - channel.start  # from the first step, weight loading excluded
    gathered = [None] * env.world_size if env.rank == 0 else None
    mine = (list(channel.outputs.values()), channel.steps)
    dist.gather_object(mine, gathered, dst=0, group=ctx.groups.cpu)
    shutdown_groups()
    if env.rank != 0:
        return 0
    results = {o.request_id: o for outs, _ in gathered for o in outs}
    steps = [s for _, part in gathered for s in part]
    missing = [i for i in range(len(items)) if i not in results]
    if missing:
        print(
            f"splitmoe.launch: error: requests {missing[:10]} produced no output", file=sys.stderr
        )
        return 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w") as f:
        for rid, (user_id, _, _) in enumerate(items):
            out = results[rid]
            if tokenizer is not None:
                out.text = tokenizer.decode(out.token_ids)
            row = out.to_dict()
            if user_id is not None:
                row["id"] = user_id
            f.write(json.dumps(row) + "\n")
    n_out = sum(len(o.token_ids) for o in results.values())
    print(
        f"splitmoe.launch: {len(items)} requests, {n_out} tokens in {elapsed:.2f}s "
        f"({n_out / elapsed:.1f} tok/s) on {cfg.parallel.attention_ranks} attention + "
        f"{cfg.parallel.expert_ranks} expert ranks, {ctx.topo.num_nodes} node(s) -> {args.output}"
    )
    if args.metrics:
        print(summarize(list(results.values()), steps, elapsed).table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
