"""PD soak: random requests through the prefill-decode router while the prefill instance is
stopped (SIGSTOP) and continued, and a decode attention rank is killed; then end-of-run checks.

    python scripts/soak_pd.py --requests 400
    python scripts/soak_pd.py --requests 60 --concurrency 8      # a quick one (the suite's)

Starts its own processes: a prefill instance (1+0), a decode instance (2+0, fault-tolerant:
a lost attention rank's requests resume on the other), Mooncake over TCP between them, and
the router in front (``--prefill-timeout``: a stopped prefill instance holds a request that
long at most, then the decode instance computes the prompt). Every request is greedy with
``ignore_eos``, streamed or not, so its answer must have exactly ``max_tokens`` tokens.

Checks (exit status 1 if any fails):
* every request was answered exactly once, 200, with ``max_tokens`` tokens (a stream's deltas
  add up to them, ending in ``[DONE]``);
* the decode instance recovered from the lost rank (``splitmoe:recoveries_total``);
* every KV block is free again on both instances, nothing parked (after the transfer timeout,
  for what was parked while nobody could read it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pd import Proc  # noqa: E402

from splitmoe.kv_transfer.auth import HEADER, SECRET_ENV, sign  # noqa: E402
from splitmoe.models.config import ModelConfig  # noqa: E402
from splitmoe.models.default_model import default_model_path  # noqa: E402


def spawned_ranks(pid: int) -> list[int]:
    """A server's rank processes, in rank order (the front end starts them in that order): its
    spawned children, and the children of its fork server (`splitmoe.engine.procs`)."""

    def kids(parent: int) -> list[tuple[int, int, bytes]]:  # (start time, pid, command line)
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat[1]) == parent:
                out.append((int(stat[19]), int(d.name), cmdline))
        return out

    ranks = []
    for started, child, cmdline in kids(pid):
        if b"spawn_main" in cmdline:
            ranks.append((started, child))
        elif b"multiprocessing.forkserver" in cmdline:
            ranks += [(s, p) for s, p, _ in kids(child)]
    return [p for _, p in sorted(ranks)]


def kv_ranks(url: str, secret: bytes) -> list[dict]:
    headers = {HEADER: sign(secret, b"/internal/kv")}
    return httpx.get(url + "/internal/kv", headers=headers, timeout=10).json()["ranks"]


def metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    )


async def one(http: httpx.AsyncClient, url: str, prompt, max_tokens: int, stream: bool):
    """``(tokens, error)`` of one request through the router."""
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
    }
    if not stream:
        r = await http.post(url + "/v1/completions", json=body)
        if r.status_code != 200:
            return None, f"{r.status_code}: {r.text[:200]}"
        return r.json()["choices"][0]["token_ids"], None
    tokens, done = [], False
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return None, f"{r.status_code}: {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return None, f"error event: {event['error']}"
            for c in event.get("choices", []):
                tokens += c.get("token_ids") or []
    return tokens, None if done else "no [DONE]"


async def drive(args, url: str, work, faults) -> dict:
    results: dict[int, list] = {}
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:

        async def run(i, prompt, max_tokens, stream):
            async with sem:
                got = await one(http, url, prompt, max_tokens, stream)
            results.setdefault(i, []).append(got)
            await faults(len(results))

        await asyncio.gather(*(run(i, *w) for i, w in enumerate(work)))
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the built-in model)")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=48)
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--stop-seconds", type=float, default=6.0, help="the prefill's SIGSTOP")
    ap.add_argument("--prefill-timeout", type=float, default=3.0)
    ap.add_argument("--kv-transfer-timeout", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logs", default=None, help="the servers' logs go here")
    args = ap.parse_args()
    os.environ.setdefault(SECRET_ENV, secrets.token_hex(32))  # (the processes share it)
    secret = os.environ[SECRET_ENV].encode()
    model = args.model or default_model_path()
    vocab = ModelConfig.from_hf(model).vocab_size
    rng = random.Random(args.seed)
    work = [
        (
            [rng.randrange(1, vocab) for _ in range(rng.randint(1, args.max_prompt))],
            rng.randint(1, args.max_output),
            rng.random() < 0.5,
        )
        for _ in range(args.requests)
    ]
    logs = Path(args.logs or tempfile.mkdtemp(prefix="soak_pd-"))
    common = ["--model", model, "--device", "cpu", "--dtype", "float32", "--no-warmup"]
    common += ["--served-model-name", "m", "--kv-connector", "mooncake"]
    common += ["--kv-transfer-timeout", str(args.kv_transfer_timeout)]
    procs, failures = [], []
    try:
        procs.append(Proc("splitmoe.serve", [*common, "--kv-role", "prefill"], logs))
        decode = [*common, "--kv-role", "decode", "--attention-ranks", "2"]
        procs.append(
            Proc("splitmoe.serve", [*decode, "--fault-tolerance", "--timeout", "10"], logs)
        )
        prefill, decode = procs
        route = ["--prefill", prefill.url, "--decode", decode.url]
        procs.append(
            Proc("splitmoe.router", [*route, "--prefill-timeout", str(args.prefill_timeout)], logs)
        )
        router = procs[2]
        victim = spawned_ranks(decode.proc.pid)[1]  # decode attention rank 1
        for p in (prefill, decode):  # (a fresh instance's first requests are slower)
            body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}
            httpx.post(p.url + "/v1/completions", json=body, timeout=120).raise_for_status()
        stop_at, kill_at = args.requests // 4, args.requests // 2
        seen = {"stopped": None, "killed": None}

        async def faults(finished: int) -> None:
            if seen["stopped"] is None and finished >= stop_at:
                seen["stopped"] = time.monotonic()
                os.killpg(prefill.proc.pid, signal.SIGSTOP)
                print(f"prefill instance stopped after {finished} requests", flush=True)
                await asyncio.sleep(args.stop_seconds)
                os.killpg(prefill.proc.pid, signal.SIGCONT)
                print("prefill instance continued", flush=True)
            if seen["killed"] is None and finished >= kill_at:
                seen["killed"] = time.monotonic()
                os.kill(victim, signal.SIGKILL)
                print(f"decode attention rank 1 killed after {finished} requests", flush=True)

        t0 = time.perf_counter()
        results = asyncio.run(drive(args, router.url, work, faults))
        took = time.perf_counter() - t0
        failures += check(args, work, results)
        recovered = metric(decode.url, "splitmoe:recoveries_total")
        if recovered < 1:
            failures.append("the decode instance reports no recovery from the lost rank")
        failures += check_free(prefill, decode, secret, args.kv_transfer_timeout * 3 + 10)
        pulled = sum(r.get("kv_transfers", 0) for r in kv_ranks(decode.url, secret))
        if not pulled:
            failures.append("the decode instance pulled no prompt's KV: PD was not exercised")
        print(
            f"{len(work)} requests in {took:.1f} s; {pulled} pulled; recoveries {recovered:g}; "
            "router: "
            f"{httpx.get(router.url + '/health', timeout=10).json()}",
            flush=True,
        )
    finally:
        for p in reversed(procs):
            try:
                os.killpg(p.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.stop()
    for f in failures:
        print("FAILED:", f)
    print("soak_pd:", "FAILED" if failures else "passed", f"(logs in {logs})")
    return 1 if failures else 0


def check(args, work, results) -> list[str]:
    out = []
    missing = [i for i in range(len(work)) if i not in results]
    twice = [i for i, r in results.items() if len(r) > 1]
    bad = []
    for i, got in results.items():
        tokens, error = got[0]
        if error is not None or len(tokens) != work[i][1]:
            bad.append((i, error or f"{len(tokens)} tokens, not {work[i][1]}"))
    if missing:
        out.append(f"{len(missing)} requests never answered, e.g. {missing[:5]}")
    if twice:
        out.append(f"{len(twice)} requests answered twice")
    if bad:
        out.append(f"{len(bad)} requests failed or came back short, e.g. {bad[:3]}")
    return out


def check_free(prefill, decode, secret: bytes, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        ranks = kv_ranks(prefill.url, secret) + kv_ranks(decode.url, secret)
        busy = [r for r in ranks if r.get("kv_blocks_used") or r.get("kv_parked")]
        if not busy:
            return []
        if time.monotonic() > deadline:
            return [f"KV blocks still held {timeout:g} s after the run: {busy}"]
        time.sleep(0.5)


if __name__ == "__main__":
    raise SystemExit(main())
