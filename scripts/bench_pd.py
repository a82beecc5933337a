"""Mixed workload, PD against one pool: decode TPOT p99 of short requests beside long prompts.

    python scripts/bench_pd.py                        # realistic model, 2,048-token prompts
    python scripts/bench_pd.py --model default --long-len 512 --num-short 16   # a quick try

Starts the servers itself, one setup after the other on the same machine:

* **PD**: a prefill instance (``--attention-ranks 1 --kv-role prefill``), a decode instance
  (``--attention-ranks 1 --expert-ranks 1 --kv-role decode``), Mooncake over TCP between them,
  `splitmoe.router` in front (issue 43);
* **one pool** of the same total ranks: ``--attention-ranks 2 --expert-ranks 1``.

Each gets the same stream: ``--num-short`` short decode-heavy requests (``--short-len`` prompt
tokens, ``--short-out`` output tokens, Poisson at ``--rate`` per second) with ``--num-long``
prompts of ``--long-len`` tokens (``--long-out`` output tokens) spread evenly among them; every
request streams. One row per setup: the short requests' TPOT (per request: its decode time over
its tokens after the first) p50 / p99 and their worst inter-token gap p99, the long prompts'
TTFT, and for PD the TTFT split and the KV bytes moved (`bench_serving.pd_table`). ``--json``
writes both rows. Prefill and decode compete for the same cores in both setups here: on a
machine with fewer cores than rank processes, PD's separation buys less than on GPUs, and the
note says so with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import _one_http, pd_snapshot, pd_snapshot_after, pd_split, pd_table  # noqa: E402

from splitmoe.kv_transfer.auth import SECRET_ENV  # noqa: E402
from splitmoe.models.config import ModelConfig  # noqa: E402
from splitmoe.models.default_model import resolve_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server (``splitmoe.serve``) or the router as a subprocess, healthy or an error."""

    def __init__(self, module: str, args: list[str], log_dir: Path, timeout: float = 300):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        self.log_path = log_dir / f"{module.rsplit('.', 1)[-1]}-{self.port}.log"
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", module, "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited: see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{' '.join(cmd)} not healthy in {timeout} s")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # (its own session: the server and its ranks)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def workload(args, vocab: int) -> list[tuple[float, list[int], int, bool]]:
    """``(arrival s, prompt, max_tokens, long)``: Poisson short requests, long ones spread
    evenly among them."""
    rng = random.Random(args.seed)
    out, t = [], 0.0
    for _ in range(args.num_short):
        prompt = [rng.randrange(1, vocab) for _ in range(args.short_len)]
        out.append((t, prompt, args.short_out, False))
        t += rng.expovariate(args.rate) if args.rate != math.inf else 0.0
    for i in range(args.num_long):
        at = t * (i + 0.5) / args.num_long
        prompt = [rng.randrange(1, vocab) for _ in range(args.long_len)]
        out.append((at, prompt, args.long_out, True))
    return sorted(out, key=lambda r: r[0])


async def drive(url: str, items, temperature: float, warm_up: bool = False) -> list:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        name = (await http.get(url + "/v1/models")).json()["data"][0]["id"]

        def body(prompt, max_tokens, seed):
            return {"model": name, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": temperature, "ignore_eos": True, "seed": seed,
                    "return_token_ids": True}  # fmt: skip

        if warm_up:
            await _one_http(http, url + "/v1/completions", body([1, 2, 3], 2, 0), True)
            return []
        start = time.perf_counter()

        async def one(i, at, prompt, max_tokens):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            return await _one_http(http, url + "/v1/completions", body(prompt, max_tokens, i), True)

        return await asyncio.gather(
            *(one(i, at, p, o) for i, (at, p, o, _) in enumerate(items)), return_exceptions=True
        )


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def row(name: str, items, outs, wall: float) -> dict:
    errors = [o for o in outs if isinstance(o, BaseException)]
    short = [o for o, it in zip(outs, items) if not it[3] and not isinstance(o, BaseException)]
    long = [o for o, it in zip(outs, items) if it[3] and not isinstance(o, BaseException)]
    tpot = [o.metrics.tpot for o in short if o.metrics.num_output_tokens > 1]
    gaps = [max(o.metrics.tbt) for o in short if o.metrics.tbt]
    wrong = sum(len(o.token_ids) != it[2] for o, it in zip(outs, items) if o in short + long)
    return {
        "setup": name,
        "errors": len(errors),
        "wrong_length": wrong,
        "short_tpot_p50_ms": pct(tpot, 0.5) * 1e3,
        "short_tpot_p99_ms": pct(tpot, 0.99) * 1e3,
        "short_max_gap_p99_ms": pct(gaps, 0.99) * 1e3,
        "short_ttft_p50_ms": pct([o.metrics.ttft for o in short], 0.5) * 1e3,
        "long_ttft_p50_ms": pct([o.metrics.ttft for o in long], 0.5) * 1e3,
        "long_ttft_max_ms": max((o.metrics.ttft for o in long), default=float("nan")) * 1e3,
        "wall_s": wall,
        "first_error": repr(errors[0])[:300] if errors else None,
    }


def run_setup(name: str, url: str, items, args) -> dict:
    asyncio.run(drive(url, items, args.temperature, warm_up=True))
    before = pd_snapshot(url)  # (after the warm-up: the split counts the stream's requests)
    t0 = time.perf_counter()
    outs = asyncio.run(drive(url, items, args.temperature))
    r = row(name, items, outs, time.perf_counter() - t0)
    if before is not None:
        ok = [o for o in outs if not isinstance(o, BaseException)]
        ttft = sum(o.metrics.ttft for o in ok) / max(1, len(ok))
        r["pd"] = pd_split(before, pd_snapshot_after(url, before), ttft)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default="realistic", help="checkpoint or preset (default: realistic)"
    )
    ap.add_argument("--num-short", type=int, default=64)
    ap.add_argument("--short-len", type=int, default=32)
    ap.add_argument("--short-out", type=int, default=64)
    ap.add_argument("--num-long", type=int, default=4)
    ap.add_argument("--long-len", type=int, default=2048)
    ap.add_argument("--long-out", type=int, default=4)
    ap.add_argument("--rate", type=float, default=4.0, help="short requests/s (inf: all at once)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("pd", "pool"), default=None, help="run one setup")
    ap.add_argument("--logs", default="/tmp", help="servers' logs go here")
    ap.add_argument("--json", default=None, help="write both rows here")
    args = ap.parse_args()
    os.environ.setdefault(SECRET_ENV, secrets.token_hex(32))  # (the PD processes share it)
    model = resolve_model(args.model)
    cfg = ModelConfig.from_hf(model)
    need = max(args.long_len + args.long_out, args.short_len + args.short_out)
    if need > cfg.max_position_embeddings:
        sys.exit(
            f"--long-len {args.long_len} + --long-out exceeds the model's context "
            f"({cfg.max_position_embeddings}): use --model realistic or a shorter prompt"
        )
    items = workload(args, cfg.vocab_size)
    logs = Path(args.logs)
    common = ["--model", model, "--served-model-name", "m", "--device", "cpu", "--dtype",
              args.dtype, "--max-num-batched-tokens", str(args.max_num_batched_tokens)]  # fmt: skip
    mooncake = ["--kv-connector", "mooncake"]
    rows = []
    if args.only in (None, "pd"):
        procs = []
        prefill = [*common, "--attention-ranks", "1", "--kv-role", "prefill", *mooncake]
        decode = [*common, "--attention-ranks", "1", "--expert-ranks", "1"]
        decode += ["--kv-role", "decode", *mooncake]
        try:
            procs.append(Proc("splitmoe.serve", prefill, logs))
            procs.append(Proc("splitmoe.serve", decode, logs))
            router = ["--prefill", procs[0].url, "--decode", procs[1].url]
            procs.append(Proc("splitmoe.router", router, logs))
            rows.append(run_setup("PD: prefill 1+0, decode 1+1, router", procs[2].url, items, args))
        finally:
            for p in reversed(procs):
                p.stop()
    if args.only in (None, "pool"):
        pool_args = [*common, "--attention-ranks", "2", "--expert-ranks", "1"]
        pool = Proc("splitmoe.serve", pool_args, logs)
        try:
            rows.append(run_setup("one pool 2+1", pool.url, items, args))
        finally:
            pool.stop()
    print(
        f"\n{cfg.model_type} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_experts} experts), {args.dtype}; {args.num_short} short requests "
        f"({args.short_len} -> {args.short_out} tokens, {args.rate}/s) with {args.num_long} "
        f"prompts of {args.long_len} tokens; {os.cpu_count()} cores"
    )
    print(f"{'setup':<38}{'TPOT p50':>9}{'p99':>8}{'gap p99':>9}{'TTFT':>8}{'long TTFT':>10}"
          f"{'wall s':>8}{'errors':>7}")  # fmt: skip
    for r in rows:
        print(
            f"{r['setup']:<38}{r['short_tpot_p50_ms']:>9.1f}{r['short_tpot_p99_ms']:>8.1f}"
            f"{r['short_max_gap_p99_ms']:>9.1f}{r['short_ttft_p50_ms']:>8.0f}"
            f"{r['long_ttft_p50_ms']:>10.0f}{r['wall_s']:>8.1f}{r['errors']:>7}"
        )
    print("(ms; TPOT, TTFT: short requests; gap: a request's longest wait between two tokens)")
    for r in rows:
        if r.get("pd"):
            print(f"\n{r['setup']}:\n{pd_table(r['pd'])}")
        if r["first_error"]:
            print(f"{r['setup']}: first error: {r['first_error']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 1 if any(r["errors"] or r["wrong_length"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
