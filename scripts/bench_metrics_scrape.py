"""Decode throughput of a server under load, without and with ``GET /metrics`` scrapes.

Starts ``python -m splitmoe.serve`` on ``--model`` (a checkpoint, or a preset: ``default``,
``realistic``), then runs rounds of ``--streams`` concurrent streaming greedy completions
(``ignore_eos``, ``--max-tokens`` each), alternately without scraping and with ``--scrapes``
scrapes of /metrics spread evenly over the run (its length taken from the last quiet run). In
each pair the order flips (quiet, scraped; scraped, quiet; ...) so that drift in the host's
speed falls on both alike. Decode tokens/s of a run: tokens after each stream's first, over the
time from the first stream's first token to the last stream's last.

On a host shared with other work, whole runs differ by more than the effect measured; the last,
interleaved run compares windows of ``--window-s`` seconds within one run instead: scrapes in
every other window (at twice the rate of a scraped run, the same number in all), tokens counted
per window, so that a neighbour's load falls on quiet and scraped windows alike. The server
process's CPU time per scrape is printed too (HTTP handling and rendering: what a scrape takes
from the cores the ranks share).

    python scripts/bench_metrics_scrape.py                                 # default model, 1+1
    python scripts/bench_metrics_scrape.py --model realistic --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

from splitmoe.models.default_model import resolve_model


@dataclass
class Run:
    decode_tps: float
    seconds: float
    scrape_s: list[float]  # each scrape's latency
    server_cpu_s: float  # CPU time of the server process (HTTP and front end, not its ranks)
    start: float  # time.monotonic() when the requests went out
    token_times: list[list[float]]  # per stream, each token's arrival


def _cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (its threads, not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, model: str) -> tuple[subprocess.Popen, str, object]:
    port = _free_port()
    cmd = [sys.executable, "-m", "splitmoe.serve", "--model", model, "--port", str(port)]
    cmd += ["--attention-ranks", str(args.attention_ranks)]
    cmd += ["--expert-ranks", str(args.expert_ranks)]
    cmd += ["--max-num-seqs", str(max(args.streams, 16)), "--served-model-name", "bench"]
    log = tempfile.NamedTemporaryFile("w+", prefix="bench-metrics-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"the server exited ({proc.returncode}):\n{log.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the server was not healthy in {args.start_timeout} s ({log.name})")
        time.sleep(0.3)


async def _stream(client, url: str, body: dict) -> list[float]:
    """The arrival time of each token of one streamed completion."""
    times: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"a request failed: {r.status_code} {await r.aread()!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                now = time.monotonic()
                for c in json.loads(line[6:])["choices"]:
                    times += [now] * len(c.get("token_ids") or [])
    return times


async def _scrape(
    client, url: str, count: int, every_s: float, latencies: list[float], window_s: float, t0: float
) -> None:
    """``count`` scrapes ``every_s`` apart; with ``window_s``, only in the odd windows of that
    length since ``t0`` (the even ones stay quiet)."""
    for _ in range(count):
        await asyncio.sleep(every_s)
        if window_s:
            k, into = divmod(time.monotonic() - t0, window_s)
            if k % 2 == 0:
                await asyncio.sleep(window_s - into)
        start = time.monotonic()
        r = await client.get(url + "/metrics")
        latencies.append(time.monotonic() - start)
        if r.status_code != 200:
            raise SystemExit(f"a scrape failed: {r.status_code}")


async def one_run(
    args,
    url: str,
    pid: int,
    prompts: list[list[int]],
    scrapes: int,
    every_s: float,
    window_s: float = 0.0,
) -> Run:
    cpu0 = _cpu_seconds(pid)
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        bodies = [
            {
                "model": "bench",
                "prompt": p,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                "stream": True,
            }
            for p in prompts
        ]
        t0 = time.monotonic()
        streams = asyncio.gather(*(_stream(client, url, b) for b in bodies))
        latencies: list[float] = []
        scraper = asyncio.create_task(
            _scrape(client, url, scrapes, every_s, latencies, window_s, t0)
        )
        times = await streams
        await scraper  # (it may end after the streams: its scrapes all count)
        seconds = time.monotonic() - t0
    if any(len(t) != args.max_tokens for t in times):
        raise SystemExit(
            f"a stream got {sorted(set(map(len, times)))} tokens, not {args.max_tokens}"
        )
    first, last = min(t[0] for t in times), max(t[-1] for t in times)
    decoded = sum(len(t) - 1 for t in times)
    cpu = _cpu_seconds(pid) - cpu0
    return Run(decoded / (last - first), seconds, latencies, cpu, t0, times)


def windowed(run: Run, window_s: float) -> tuple[float, float, int]:
    """Decode tokens/s in the quiet (even) and scraped (odd) windows of an interleaved run, over
    the whole windows from the third (past prefill) to the last before a stream finished; and
    how many window pairs that is."""
    end = min(t[-1] for t in run.token_times) - run.start
    last = int(end // window_s)  # (the first window not whole)
    counts = [0] * (last + 1)
    for stream in run.token_times:
        for t in stream[1:]:
            k = int((t - run.start) // window_s)
            if k < last:
                counts[k] += 1
    first = 2
    last -= (last - first) % 2  # (whole pairs: even, odd)
    quiet = sum(counts[k] for k in range(first, last, 2))
    scraped = sum(counts[k] for k in range(first + 1, last, 2))
    pairs = (last - first) // 2
    return quiet / (pairs * window_s), scraped / (pairs * window_s), pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint, or preset: default, realistic")
    ap.add_argument("--attention-ranks", type=int, default=1)
    ap.add_argument("--expert-ranks", type=int, default=1)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--scrapes", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5, help="pairs of runs (quiet, scraped)")
    ap.add_argument(
        "--window-s", type=float, default=0.5, help="interleaved run's windows (0: none)"
    )
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = resolve_model(args.model)
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.streams)
    ]
    proc, url, log = start_server(args, model)
    try:
        warm = asyncio.run(one_run(args, url, proc.pid, prompts, 0, 0.0))  # (first-use costs)
        last_quiet = warm.seconds
        quiet: list[Run] = []
        scraped: list[Run] = []
        for i in range(args.rounds):
            for scrape in (False, True) if i % 2 == 0 else (True, False):
                every = last_quiet / (args.scrapes + 1)
                run = asyncio.run(
                    one_run(args, url, proc.pid, prompts, args.scrapes if scrape else 0, every)
                )
                (scraped if scrape else quiet).append(run)
                if not scrape:
                    last_quiet = run.seconds
            q, s = quiet[-1], scraped[-1]
            lat = sorted(s.scrape_s)
            print(
                f"round {i}: quiet {q.decode_tps:8.1f} tok/s, scraped {s.decode_tps:8.1f} tok/s "
                f"({len(lat)} scrapes, p50 {lat[len(lat) // 2] * 1e3:.1f} ms, "
                f"max {lat[-1] * 1e3:.1f} ms): ratio {s.decode_tps / q.decode_tps:.3f}; "
                f"server CPU {q.server_cpu_s:.2f} s / {s.server_cpu_s:.2f} s",
                flush=True,
            )
        inter = None
        if args.window_s:  # scrapes in every other window, as many as in a scraped run
            every = last_quiet / 2 / (args.scrapes + 1)
            run = asyncio.run(
                one_run(args, url, proc.pid, prompts, args.scrapes, every, args.window_s)
            )
            inter = windowed(run, args.window_s)
        if proc.poll() is not None:
            raise SystemExit("the server died during the runs")
    finally:
        proc.terminate()
        proc.wait(60)
    ratios = [s.decode_tps / q.decode_tps for q, s in zip(quiet, scraped)]
    cpu = _cpu_model()
    print(
        f"\n{args.model or 'default'} model, {args.attention_ranks}+{args.expert_ranks} ranks, "
        f"{args.streams} streams x {args.max_tokens} tokens, {args.scrapes} scrapes per run, "
        f"{cpu}, {os.cpu_count()} cores"
    )
    print(f"decode tokens/s without scraping: {statistics.median(r.decode_tps for r in quiet):.1f}")
    print(
        f"decode tokens/s with scraping:    {statistics.median(r.decode_tps for r in scraped):.1f}"
    )
    spread = ", ".join(f"{r:.3f}" for r in ratios)
    print(f"scraped / quiet: median {statistics.median(ratios):.3f} (per round: {spread})")
    extra = statistics.median(s.server_cpu_s - q.server_cpu_s for q, s in zip(quiet, scraped))
    print(
        f"server process CPU per scrape: {extra / args.scrapes * 1e3:.2f} ms "
        f"(median over rounds of the scraped run's CPU time minus the quiet run's)"
    )
    if inter is not None:
        q, s, pairs = inter
        print(
            f"interleaved run ({pairs} pairs of {args.window_s} s windows, {args.scrapes} "
            f"scrapes in the odd ones): quiet {q:.1f} tok/s, scraped {s:.1f} tok/s, "
            f"ratio {s / q:.3f}"
        )


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "CPU unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "CPU unknown"


if __name__ == "__main__":
    main()
