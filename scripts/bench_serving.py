"""Replay a request stream against a topology, or a running server, and report serving metrics.

    python scripts/bench_serving.py --attention-ranks 2 --expert-ranks 1 --num-requests 500 \
        --rate 50 --prompt-len uniform:4:64 --output-len uniform:4:32
    python -m splitmoe.serve --model CKPT --port 8000 &
    python scripts/bench_serving.py --url http://127.0.0.1:8000 --model CKPT --num-requests 500 \
        --rate 50 --shared-prefix-len 256 --num-prefixes 8

Requests arrive as a Poisson process at ``--rate`` per second (``inf``: all at once), with
prompt and output lengths drawn from distributions (``fixed:N``, ``uniform:LO:HI``,
``lognormal:MEAN:SIGMA``) or taken from a JSONL file (``--dataset``, lines as for
`splitmoe.launch`). At the end it checks that every request finished exactly once with its
expected number of tokens, and prints the metrics table (throughput, TTFT/TBT percentiles, KV
usage, batch sizes). The scaling study drives this script; ``--json FILE`` writes its figures.

With ``--url`` the same stream goes to an OpenAI-compatible server (``python -m splitmoe.serve``)
as ``/v1/completions`` requests from an asyncio client, streamed (``--no-stream``: whole
responses), and the same table is printed from what the client measured: TTFT and TBT from the
chunks' arrival, cached prompt tokens from ``usage`` (the per-step rows, batch sizes and KV
usage, are the ranks' and stay 0 here: see the server's ``/metrics``). ``--model`` must then
name the checkpoint the server serves (its vocabulary and context are read from it).
``--shared-prefix-len N --num-prefixes K`` starts every prompt with one of K random prefixes of N
tokens (chat and agent traffic: system prompts, history), which the prefix cache serves.

When ``--url`` is a prefill-decode router (``python -m splitmoe.router``, docs/pd.md), the
table is followed by the TTFT split from the ``/metrics`` of the router and of its instances,
scraped before and after the run: the prefill stage (router to prefill instance and back), the
decode instance's KV pull and first step, what is left (queues, HTTP), and the bytes moved
and their bandwidth (``"pd"`` in ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from pathlib import Path

from splitmoe import LLM, SamplingParams
from splitmoe.metrics import summarize
from splitmoe.models.config import ModelConfig
from splitmoe.models.default_model import resolve_model
from splitmoe.outputs import RequestMetrics, RequestOutput


def parse_dist(spec: str):
    """``fixed:N`` | ``uniform:LO:HI`` | ``lognormal:MEAN:SIGMA`` -> a sampler of ints >= 1."""
    kind, *a = spec.split(":")
    if kind == "fixed" and len(a) == 1:
        n = int(a[0])
        return lambda rng: n
    if kind == "uniform" and len(a) == 2:
        lo, hi = int(a[0]), int(a[1])
        return lambda rng: rng.randint(lo, hi)
    if kind == "lognormal" and len(a) == 2:
        mean, sigma = float(a[0]), float(a[1])
        mu = math.log(mean) - sigma**2 / 2
        return lambda rng: max(1, round(rng.lognormvariate(mu, sigma)))
    raise SystemExit(f"bad length distribution {spec!r}: use fixed:N, uniform:LO:HI, lognormal:M:S")


def make_workload(args, vocab: int, max_len: int):
    rng = random.Random(args.seed)
    if args.dataset:
        items = []
        for line in Path(args.dataset).read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                items.append((d["prompt_token_ids"], int(d.get("max_tokens", args.default_max))))
    else:
        plen, olen = parse_dist(args.prompt_len), parse_dist(args.output_len)
        prefixes = [
            [rng.randrange(1, vocab) for _ in range(args.shared_prefix_len)]
            for _ in range(args.num_prefixes if args.shared_prefix_len else 0)
        ]
        items = []
        for _ in range(args.num_requests):
            prefix = rng.choice(prefixes) if prefixes else []
            p = min(plen(rng), max_len - 2 - len(prefix))
            o = min(olen(rng), max_len - 1 - p - len(prefix))
            items.append((prefix + [rng.randrange(1, vocab) for _ in range(p)], o))
    t, arrivals = 0.0, []
    for _ in items:
        arrivals.append(t)
        if args.rate != math.inf:
            t += rng.expovariate(args.rate)
    return items, arrivals


def run_in_process(args, items, arrivals):
    """Returns (metrics, {request: tokens expected}, {request: tokens got}, duplicates)."""
    with LLM(
        args.model,
        attention_ranks=args.attention_ranks,
        expert_ranks=args.expert_ranks,
        transport=args.transport,
        device="cpu",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        threads_per_rank=args.threads_per_rank,
        enable_prefix_caching=not args.no_prefix_caching,
    ) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
        llm.reset_metrics()
        expected: dict[int, int] = {}
        finished: dict[int, int] = {}
        duplicates = 0
        if args.rate == math.inf:  # all at once: one `generate` call
            outs = llm.generate([p for p, _ in items], _params(args, items), use_tqdm=False)
            for i, (out, (_, o)) in enumerate(zip(outs, items)):
                expected[i], finished[i] = o, len(out.token_ids)
            return llm.metrics(), expected, finished, 0
        start = time.perf_counter()
        nxt = 0
        while nxt < len(items) or len(finished) < len(items):
            now = time.perf_counter() - start
            batch = []
            while nxt < len(items) and arrivals[nxt] <= now:
                batch.append(items[nxt])
                nxt += 1
            if batch:
                rids = llm.submit([p for p, _ in batch], _params(args, batch, nxt - len(batch)))
                for rid, (_, o) in zip(rids, batch):
                    expected[rid] = o
            wait = 0.05 if nxt >= len(items) else max(0.0, arrivals[nxt] - now)
            for out, _ in llm.poll(timeout=min(wait, 0.05)):
                if out.finished:
                    duplicates += out.request_id in finished
                    finished[out.request_id] = len(out.token_ids)
        return llm.metrics(), expected, finished, duplicates


def _params(args, items, first: int = 0) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=o, temperature=args.temperature, ignore_eos=True, seed=args.seed + first + i
        )
        for i, (_, o) in enumerate(items)
    ]


async def _one_http(http, url: str, body: dict, stream: bool) -> RequestOutput:
    """One request; its metrics as the client saw them."""
    arrival = time.time()
    t0 = time.perf_counter()
    times: list[float] = []
    tokens: list[int] = []
    reason, usage = None, {}
    if stream:
        async with http.stream("POST", url, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                usage = chunk.get("usage") or usage
                for c in chunk["choices"]:
                    if c.get("token_ids"):
                        now = time.perf_counter() - t0
                        times += [now] * len(c["token_ids"])
                        tokens += c["token_ids"]
                    reason = c.get("finish_reason") or reason
    else:
        r = await http.post(url, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        data = r.json()
        usage, c = data["usage"], data["choices"][0]
        tokens, reason = c["token_ids"], c["finish_reason"]
        times = [time.perf_counter() - t0] * len(tokens)
    times = times or [time.perf_counter() - t0]
    n = len(tokens)
    metrics = RequestMetrics(
        arrival_time=arrival,
        queue_time=0.0,  # (not visible to a client)
        ttft=times[0],
        tpot=(times[-1] - times[0]) / (n - 1) if n > 1 else 0.0,
        e2e_latency=times[-1],
        num_prompt_tokens=len(body["prompt"]),
        num_output_tokens=n,
        num_cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        tbt=tuple(b - a for a, b in zip(times, times[1:])),
    )
    return RequestOutput(0, body["prompt"], tokens, finish_reason=reason, metrics=metrics)


async def _run_http(args, items, arrivals):
    import httpx

    url = args.url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, headers=headers, limits=limits) as http:
        models = (await http.get(args.url.rstrip("/") + "/v1/models")).json()
        name = models["data"][0]["id"]

        def body(prompt, max_tokens, seed):
            return {
                "model": name,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": args.temperature,
                "ignore_eos": True,
                "seed": seed,
                "return_token_ids": True,
                "stream_options": {"include_usage": True},
            }

        await _one_http(http, url, body([1, 2, 3], 2, 0), not args.no_stream)  # warm-up
        pd_before = pd_snapshot(args.url)  # (None unless a PD router)
        start = time.perf_counter()
        t_start = time.time()

        async def later(i, prompt, o):
            await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
            return await _one_http(http, url, body(prompt, o, args.seed + i), not args.no_stream)

        outs = await asyncio.gather(
            *(later(i, p, o) for i, (p, o) in enumerate(items)), return_exceptions=True
        )
    end = max(
        (
            o.metrics.arrival_time + o.metrics.e2e_latency
            for o in outs
            if isinstance(o, RequestOutput)
        ),
        default=t_start,
    )
    return outs, end - t_start, pd_before


def _scrape(http, url: str) -> dict[tuple[str, str], float]:
    """``/metrics`` of one server: ``(sample name, le or event label)`` -> value, summed over
    the other labels (model, rank)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(http.get(url + "/metrics").text):
        for s in fam.samples:
            key = (s.name, s.labels.get("le") or s.labels.get("event", ""))
            out[key] = out.get(key, 0.0) + s.value
    return out


def _pd_servers(http, url: str) -> dict[str, list[str]] | None:
    """The router's instances (``{"router": [url], "prefill": [...], "decode": [...]}``), or
    None when ``url`` is not a router."""
    try:
        health = http.get(url + "/health").json()
    except ValueError:
        return None
    if not isinstance(health.get("prefill"), dict) or not isinstance(health.get("decode"), dict):
        return None
    return {"router": [url], "prefill": list(health["prefill"]), "decode": list(health["decode"])}


def pd_snapshot(url: str) -> dict | None:
    """Every PD server's metrics now, or None when ``url`` is not a router."""
    import httpx

    with httpx.Client(timeout=30) as http:
        servers = _pd_servers(http, url.rstrip("/"))
        if servers is None:
            return None
        snap = {}
        for role, urls in servers.items():
            total: dict[tuple[str, str], float] = {}
            for u in urls:
                for k, v in _scrape(http, u).items():
                    total[k] = total.get(k, 0.0) + v
            snap[role] = total
        return snap


def _hist(before: dict, after: dict, name: str) -> dict:
    """Count, mean, p50, p99 of histogram ``name`` over the run (from the bucket deltas, as
    Prometheus's histogram_quantile interpolates them)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if k[0].startswith(name)}
    count = d.get((f"{name}_count", ""), 0.0)
    out = {"count": int(count), "mean": d.get((f"{name}_sum", ""), 0.0) / count if count else 0.0}
    buckets = sorted(
        (float(le), v) for (n, le), v in d.items() if n == f"{name}_bucket" and le != "+Inf"
    )
    for q in (0.5, 0.99):
        rank, lo, below, value = q * count, 0.0, 0.0, 0.0
        for le, cum in buckets:
            if count and cum >= rank:
                value = lo + (le - lo) * (rank - below) / (cum - below) if cum > below else le
                break
            lo, below, value = le, cum, le
        out[f"p{round(q * 100)}"] = value
    return out


def pd_split(before: dict, after: dict, client_ttft_mean: float) -> dict:
    """The TTFT split and the transfer figures between two `pd_snapshot`s."""
    r0, r1 = before["router"], after["router"]
    d0, d1 = before["decode"], after["decode"]
    p0, p1 = before["prefill"], after["prefill"]

    def delta(a, b, name):
        return b.get((name, ""), 0.0) - a.get((name, ""), 0.0)

    split = {
        "prefill": _hist(r0, r1, "splitmoe:pd_prefill_seconds"),
        "prefill_instance_ttft": _hist(p0, p1, "splitmoe:time_to_first_token_seconds"),
        "transfer": _hist(d0, d1, "splitmoe:kv_transfer_time_seconds"),
        "first_decode_step": _hist(d0, d1, "splitmoe:first_decode_step_seconds"),
        "decode_queue": _hist(d0, d1, "splitmoe:request_queue_time_seconds"),
    }
    parts = ("prefill", "transfer", "first_decode_step")
    split["other"] = {"mean": client_ttft_mean - sum(split[k]["mean"] for k in parts)}
    nbytes = delta(d0, d1, "splitmoe:kv_transfer_bytes")
    secs = delta(d0, d1, "splitmoe:kv_transfer_seconds")
    split["kv_transfers"] = int(delta(d0, d1, "splitmoe:kv_transfers"))
    split["kv_transfer_failures"] = int(delta(d0, d1, "splitmoe:kv_transfer_failures"))
    split["kv_transfer_bytes"] = int(nbytes)
    split["kv_transfer_bandwidth"] = nbytes / secs if secs else 0.0
    event = ("splitmoe:router_events", "prefill_fallbacks")
    split["prefill_fallbacks"] = int(r1.get(event, 0.0) - r0.get(event, 0.0))
    return split


def pd_snapshot_after(url: str, before: dict, timeout: float = 5.0) -> dict:
    """`pd_snapshot` once the decode ranks' published counters caught up with the requests
    their servers counted (they lag about a second)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = pd_snapshot(url)
        d0, d1 = before["decode"], snap["decode"]
        pulls = d1.get(("splitmoe:kv_transfers", ""), 0) - d0.get(("splitmoe:kv_transfers", ""), 0)
        name = ("splitmoe:kv_transfer_time_seconds_count", "")
        counted = d1.get(name, 0) - d0.get(name, 0)
        if pulls >= counted or time.monotonic() > deadline:
            return snap
        time.sleep(0.3)


def pd_table(split: dict) -> str:
    rows = [f"{'TTFT split (PD)':<24}{'n':>6}{'mean ms':>10}{'p50 ms':>10}{'p99 ms':>10}"]
    for k in ("prefill", "transfer", "first_decode_step", "other"):
        h = split[k]
        row = f"{k:<24}{h.get('count', ''):>6}{h['mean'] * 1e3:>10.1f}"
        if "p50" in h:
            row += f"{h['p50'] * 1e3:>10.1f}{h['p99'] * 1e3:>10.1f}"
        rows.append(row)
    rows.append(
        f"KV moved: {split['kv_transfers']} pulls, {split['kv_transfer_bytes'] / 2**20:.2f} MiB "
        f"at {split['kv_transfer_bandwidth'] / 2**30:.2f} GiB/s, "
        f"{split['kv_transfer_failures']} failed"
    )
    return "\n".join(rows)


def run_http(args, items, arrivals):
    """As `run_in_process`, plus the PD split (`pd_split`) when ``--url`` is a router."""
    outs, duration, pd_before = asyncio.run(_run_http(args, items, arrivals))
    errors = [o for o in outs if not isinstance(o, RequestOutput)]
    for e in errors[:5]:
        print(f"request failed: {e}", file=sys.stderr)
    done = [o for o in outs if isinstance(o, RequestOutput)]
    expected = {i: o for i, (_, o) in enumerate(items)}
    finished = {i: len(o.token_ids) for i, o in enumerate(outs) if isinstance(o, RequestOutput)}
    metrics = summarize(done, [], duration)
    split = None
    if pd_before is not None:
        ttfts = [o.metrics.ttft for o in done]
        mean = sum(ttfts) / len(ttfts) if ttfts else 0.0
        split = pd_split(pd_before, pd_snapshot_after(args.url, pd_before), mean)
    return metrics, expected, finished, 0, split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default=None, help="checkpoint or preset (default, realistic; default: default)"
    )
    ap.add_argument("--url", default=None, help="a running server (python -m splitmoe.serve)")
    ap.add_argument("--api-key", default=os.environ.get("SPLITMOE_API_KEY"))
    ap.add_argument("--no-stream", action="store_true", help="--url: whole responses")
    ap.add_argument("--attention-ranks", type=int, default=2)
    ap.add_argument("--expert-ranks", type=int, default=1)
    ap.add_argument("--transport", default="flat")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    ap.add_argument("--prompt-len", default="uniform:4:64")
    ap.add_argument("--output-len", default="uniform:4:32")
    ap.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of a shared prefix")
    ap.add_argument("--num-prefixes", type=int, default=4, help="distinct shared prefixes")
    ap.add_argument("--dataset", default=None, help="JSONL with prompt_token_ids [+ max_tokens]")
    ap.add_argument("--default-max", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--threads-per-rank", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the metrics here as JSON")
    args = ap.parse_args()
    args.model = resolve_model(args.model)
    cfg = ModelConfig.from_hf(args.model)
    items, arrivals = make_workload(args, cfg.vocab_size, cfg.max_position_embeddings)

    t0 = time.perf_counter()
    if args.url:
        metrics, expected, finished, duplicates, split = run_http(args, items, arrivals)
        where = f"server {args.url} ({'streamed' if not args.no_stream else 'whole responses'})"
    else:
        metrics, expected, finished, duplicates = run_in_process(args, items, arrivals)
        split = None
        where = (
            f"{args.attention_ranks} attention + {args.expert_ranks} expert ranks "
            f"({args.transport})"
        )
    wall = time.perf_counter() - t0

    lost = sorted(set(expected) - set(finished))
    wrong = sorted(r for r in finished if finished[r] != expected.get(r))
    print(
        f"\n{len(items)} requests at rate {args.rate}/s on {where}, model {cfg.model_type} "
        f"({cfg.num_layers} layers, {cfg.num_experts} experts), wall {wall:.1f} s"
    )
    print(metrics.table())
    if split is not None:
        print(pd_table(split))
    print(f"lost: {len(lost)}  duplicated: {duplicates}  wrong length: {len(wrong)}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    **metrics.to_dict(),
                    **vars(args),
                    "lost": len(lost),
                    "duplicates": duplicates,
                    "pd": split,
                }
            )
        )
    if lost or duplicates or wrong:
        sys.exit(f"FAILED: lost {lost[:10]}, wrong length {wrong[:10]}, duplicates {duplicates}")


if __name__ == "__main__":
    main()
