"""Scaling study: sweeps topologies and workloads with real `LLM` runs; CSV, plots, and a check
of the cluster simulator against what was measured.

    python scripts/scaling_study.py --quick --out out/scaling           # a few minutes, 2 cores
    python scripts/scaling_study.py --held-out --out out/heldout        # issue 41's held-out check
    python scripts/scaling_study.py --attention-ranks 1,2,4 --expert-ranks 0,1,2 \\
        --batch 1,8,32 --rate inf,20 --micro-batches 1,2 --transport flat,two_phase \\
        --balancer static,global --replicas 1,2 --out out/scaling

Sweep axes (comma lists): attention ranks, expert ranks (0 = colocated), closed-batch size or
Poisson request rate, micro-batches, transport, balancer (with ``--redundant-experts``) and
replicas (independent instances sharing the machine). An axis whose `LLM` option does not exist
yet (``micro_batches``, ``balancer``) or whose transport is not registered runs only at its
default and the skipped values are listed in ``notes.txt`` and on the console: nothing else
changes when the option lands.

Every run point is measured ``--repeats`` times per pass on one started instance, ``--passes``
times over the whole sweep (each pass visits the topologies in another order, so a slow minute
of the machine does not fall on one configuration), after a discarded warm-up run; the median is
kept, with the spread of the repeats (other work on the machine makes single timings noisy).
Outputs under ``--out``:

* ``scaling.csv``: one row per run point: settings; output tokens/s, per rank, TTFT/TBT
  percentiles, TPOT, comm share (attention ranks' time in collectives), expert imbalance
  (max / mean tokens served per expert rank); and, with a profile, the simulator's predictions;
* ``plots/*.png``: throughput per rank and latency against each swept axis (matplotlib; skipped,
  with a note, when it is missing), and predicted against measured;
* ``cpu_profile.json`` and ``validation.txt`` (``--validate``, on by default with ``--quick``):
  this machine's profile, calibrated at the start of the study, and the simulator's predictions
  for the closed-batch runs with their errors and verdicts (the ±15 % check of
  `splitmoe.sim.validate`).

With a check, before any run, the study reads the host's own steadiness (`host_readings`, ~5 s)
and says first whether it moves beyond the check's tolerance, and then how many repeats a point
would need (`host_check`; ``--passes`` scales them). The check validates only layouts whose rank
processes each have a core of their own (`usable_cores`, recorded per row); oversubscribed ones
are measured, predicted and plotted, marked, and count neither way. Each validation point is a
hit, a miss, or inconclusive (its repeats spread beyond the tolerance, and wherever the prediction
misses some repeat ran as slow: `splitmoe.sim.validate.verdict`). With a check (``--validate``, or
``--from-csv`` with ``--profile``) the study exits 0 when every decidable point hits, 2 when fewer
than half of the points are decidable (the host was too noisy to judge), and 1 when decidable
points miss or there was nothing to check (`exit_code`).

``--held-out``: the held-out check of docs/scaling.md §4 in one command. On the realistic preset
(``--model`` to change it) it measures the calibration runs (`CALIBRATION_RUNS`) and the 16
held-out points (`splitmoe.sim.validate.HELD_OUT_RUNS`: closed batches 8 and 32 on 1A+0E, 1A+1E,
2A+0E, 2A+1E, each at one and two micro-batches, pinned) in the same passes (5; ``--passes``
for more: each point's median is then less at the mercy of a slow minute), fits the profile
on the calibration runs alone (``--profile`` takes a frozen one instead), predicts the held-out
points, prints the table and ``held-out: N/16 within ±15%`` last, and exits by the same three
verdicts, the bar `HELD_OUT_PASS` (15 of 16) a share of the decidable points (every point counts
here, 2A+1E included). It also prints the commit of ``splitmoe/sim/`` it ran (the frozen model)
and the host's copy bandwidth and wake-up round trip before the runs (`host_probe`,
`wake_probe`): whether the machine held still. With ``--from-csv`` and ``--profile`` it
re-checks saved rows without running.
"""

from __future__ import annotations

import argparse
import csv
import functools
import itertools
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from splitmoe import LLM, SamplingParams  # noqa: E402
from splitmoe.metrics import summarize  # noqa: E402
from splitmoe.models.config import ModelConfig  # noqa: E402
from splitmoe.models.default_model import default_model_path, realistic_model_path  # noqa: E402
from splitmoe.sim.calibrate import CALIBRATION_DTYPE, decode_step_time  # noqa: E402

# axis -> (LLM keyword, default value); the default runs even when the keyword does not exist.
OPTIONAL_AXES = {
    "micro_batches": ("micro_batches", 1),
    "balancer": ("balancer", "static"),
}

FIELDS = [
    "status", "attention_ranks", "expert_ranks", "ranks", "replicas", "transport",
    "micro_batches", "balancer", "redundant_experts", "num_requests", "rate", "prompt_len",
    "max_tokens", "max_num_batched_tokens", "repeats", "duration_s", "output_tok_s",
    "output_tok_s_per_rank", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tbt_p50_ms",
    "tbt_p90_ms", "tbt_p99_ms", "tpot_mean_ms", "step_p50_ms", "comm_share", "imbalance",
    "seqs_per_step_mean", "step_min_ms", "step_max_ms", "output_tok_s_min", "output_tok_s_max",
    "load_avg", "host_gb_s", "host_gb_s_min", "host_gb_s_max", "host_wake_us", "host_wake_us_min",
    "host_wake_us_max", "pred_output_tok_s", "pred_tbt_ms",
    "pred_ttft_ms", "pred_comm_share", "err_output_tok_s", "err_tbt", "calibration", "cores",
    "verdict",
]  # fmt: skip


@dataclass(frozen=True)
class Topology:
    attention_ranks: int
    expert_ranks: int
    transport: str
    micro_batches: int
    balancer: str
    redundant_experts: int
    replicas: int

    @property
    def ranks(self) -> int:
        return self.attention_ranks + self.expert_ranks

    def llm_kwargs(self) -> dict:
        # micro_batches always: left out, the runtime picks per step (2 for AF steps of 8 or
        # more tokens per attention rank), and an "m=1" row at batch 16 would run two
        kw = dict(
            attention_ranks=self.attention_ranks,
            expert_ranks=self.expert_ranks,
            transport=self.transport,
            micro_batches=self.micro_batches,
        )
        if self.balancer != "static":
            kw["balancer"] = self.balancer
            kw["redundant_experts"] = self.redundant_experts
        return kw

    def label(self) -> str:
        return (
            f"{self.attention_ranks}A+{self.expert_ranks}E {self.transport} "
            f"m={self.micro_batches} {self.balancer} x{self.replicas}"
        )


def csv_list(kind):
    def parse(text: str):
        return [kind(x) for x in text.split(",") if x]

    return parse


def rate_value(text: str) -> float:
    return math.inf if text in ("inf", "closed") else float(text)


def supported_options() -> tuple[set[str], set[str]]:
    """`LLM`'s engine options, and registered transports."""
    from splitmoe.comm.transports import TRANSPORTS
    from splitmoe.options import engine_options

    return set(engine_options()), set(TRANSPORTS)


def plan_topologies(args, notes: list[str]) -> list[Topology]:
    """The sweep's topologies; axes the runtime cannot run yet keep only their default."""
    params, transports = supported_options()
    axes = {
        "micro_batches": args.micro_batches,
        "balancer": args.balancer,
    }
    for axis, values in axes.items():
        kw, default = OPTIONAL_AXES[axis]
        if kw not in params:
            skipped = [v for v in values if v != default]
            if skipped:
                notes.append(
                    f"skipped {axis}={skipped}: LLM has no {kw!r} option yet (ran {default!r})"
                )
            axes[axis] = [default]
    usable = [t for t in args.transport if t in transports]
    if len(usable) < len(args.transport):
        missing = [t for t in args.transport if t not in transports]
        notes.append(f"skipped transport={missing}: not registered (have {sorted(transports)})")
    usable = usable or ["flat"]
    topos = []
    for a, e, tr, m, bal, rep in itertools.product(
        args.attention_ranks,
        args.expert_ranks,
        usable,
        axes["micro_batches"],
        axes["balancer"],
        args.replicas,
    ):
        if e == 0 and (tr != usable[0] or bal != "static"):
            continue  # colocated: no transport, no expert balancer
        if bal != "static" and e < 2:
            continue  # a redundant replica must live on another expert rank than its original
        if (a + e) * rep > args.max_processes:
            notes.append(
                f"skipped {a}A+{e}E x{rep}: more than --max-processes {args.max_processes}"
            )
            continue
        topos.append(Topology(a, e, tr, m, bal, args.redundant_experts, rep))
    return topos


def held_out_plan(runs=None) -> tuple[list[Topology], dict[Topology, list[int]]]:
    """The held-out sweep's topologies and each one's closed batches: every calibration run and
    every held-out point (``runs``, default `HELD_OUT_RUNS`; flat transport, static balancer,
    micro-batches pinned)."""
    from splitmoe.sim.calibrate import CALIBRATION_RUNS
    from splitmoe.sim.validate import HELD_OUT_RUNS

    batches: dict[Topology, list[int]] = {}
    for a, e, b, m in sorted(set(CALIBRATION_RUNS) | set(runs or HELD_OUT_RUNS)):
        topo = Topology(a, e, "flat", m, "static", 0, 1)
        batches.setdefault(topo, []).append(b)
    return list(batches), batches


# what the held-out check's predictions depend on: the model is frozen when none of them changes
MODEL_FILES = tuple(
    f"splitmoe/sim/{name}.py"
    for name in ("simulator", "model", "calibrate", "validate", "hardware", "imbalance")
)


def frozen_model() -> str:
    """The last commit that changed the simulator's model (`MODEL_FILES`: what a held-out check
    freezes), and whether the working tree changes it since."""
    import subprocess

    import splitmoe.sim

    root = Path(__file__).resolve().parent.parent
    imported = Path(splitmoe.sim.__file__).resolve().parent
    if imported != root / "splitmoe" / "sim":  # (an editable install of another checkout)
        return f"model: splitmoe/sim imported from {imported}, not this tree (not a frozen model)"
    try:
        commit = subprocess.run(
            ["git", "log", "-1", "--format=%h %s", "--", *MODEL_FILES],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *MODEL_FILES],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "model: splitmoe/sim (no git history here)"
    return f"model: splitmoe/sim at {commit}" + (
        " PLUS UNCOMMITTED CHANGES (not a frozen model)" if dirty else ""
    )


def usable_cores() -> int:
    """The cores this process may run on (its affinity: what a container's cpuset or `taskset`
    leaves), not the host's count: a rank process spins while it waits only with a core of its
    own, and sleeps on a futex otherwise."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity call on macOS)
        return os.cpu_count() or 1


# ---- one run point ----------------------------------------------------------------------------
@functools.cache
def _probe_buffers() -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randn(16 * 2**20)  # 64 MiB
    return src, torch.empty_like(src)


def host_probe() -> float:
    """This host's single-thread copy bandwidth now (GB/s, read + written; the best of 3
    copies of 64 MiB, ~15 ms): taken before each measured run, it says whether the machine
    held still while the study ran. A VM's neighbours move it with nothing of ours running (by tens
    of percent within a minute), and a load average does not see that. The decode steps of the
    realistic preset read their weights from memory."""
    src, dst = _probe_buffers()
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def wake_probe(trips: int = 200) -> float | None:
    """This host's wake-up round trip now (microseconds, the median of ``trips``): a byte sent
    to a forked process that sleeps waiting for it, and its answer, ~15-40 ms in all. A rank
    that shares the cores sleeps in each exchange and is woken by its peer's message, so the
    topologies of more rank processes than cores pay this every layer; a VM's neighbours move it (by
    a factor of several within a minute) where the copy bandwidth barely moves. None where processes
    cannot be forked."""
    if not hasattr(os, "fork"):
        return None
    ping, pong = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child only reads and writes its pipes)
        try:
            for _ in range(trips):
                os.read(ping[0], 1)
                os.write(pong[1], b"x")
        finally:
            os._exit(0)
    times = []
    try:
        for _ in range(trips):
            t = time.perf_counter()
            os.write(ping[1], b"x")
            os.read(pong[0], 1)
            times.append(time.perf_counter() - t)
    finally:
        os.waitpid(pid, 0)
        for fd in (*ping, *pong):
            os.close(fd)
    return statistics.median(times) * 1e6


# the host probes taken before each run: (row key, what it measures, unit, format)
HOST_PROBES = (
    ("host_gb_s", "copy bandwidth", " GB/s", "{:.1f}"),
    ("host_wake_us", "wake-up round trip", " us", "{:.0f}"),
)


def _probe_text(what: str, unit: str, fmt: str, lo: float, hi: float, mid: float) -> str:
    return (
        f"{what} {fmt.format(lo)}-{fmt.format(hi)}{unit} (median {fmt.format(mid)}; "
        f"{lo / mid - 1:+.0%} / {hi / mid - 1:+.0%})"
    )


def _beyond(lo: float, hi: float, mid: float, tolerance: float) -> bool:
    return hi > mid * (1 + tolerance) or lo < mid * (1 - tolerance)


def _probe_range(rows: list[dict], key: str) -> tuple[float, float, float] | None:
    """(lowest, highest, median) of probe ``key`` over the rows that have it."""
    probed = [r for r in rows if r.get(f"{key}_min") not in (None, "")]
    if not probed:
        return None
    lo = min(float(r[f"{key}_min"]) for r in probed)
    hi = max(float(r[f"{key}_max"]) for r in probed)
    return lo, hi, statistics.median(float(r[key]) for r in probed)


def host_line(rows: list[dict], tolerance: float) -> str:
    """The host probes' ranges over a study (`host_probe`, `wake_probe`), and whether the
    machine's own speed moved by more than the check's ``tolerance`` about their medians (then
    the study measured the host as much as the runtime: no check on it is a test of the
    model)."""
    parts, moved = [], False
    for key, what, unit, fmt in HOST_PROBES:
        got = _probe_range(rows, key)
        if got is None:
            continue
        moved |= _beyond(*got, tolerance)
        parts.append(_probe_text(what, unit, fmt, *got))
    if not parts:
        return ""
    return (
        "host: before the runs, "
        + ", ".join(parts)
        + ": "
        + ("moved beyond" if moved else "held within")
        + f" ±{tolerance:.0%}"
    )


def host_readings(readings: int = 16, gap_s: float = 0.2) -> dict[str, list[float]]:
    """``readings`` of each host probe (`HOST_PROBES`), ``gap_s`` apart (~5 s in all), before
    anything of the study runs: the host's own steadiness, which bounds what a point can show."""
    out: dict[str, list[float]] = {key: [] for key, *_ in HOST_PROBES}
    for i in range(readings):
        if i:
            time.sleep(gap_s)
        out["host_gb_s"].append(host_probe())
        wake = wake_probe()
        if wake is not None:
            out["host_wake_us"].append(wake)
    return {k: v for k, v in out.items() if v}


def repeats_needed(values: list[float], tolerance: float) -> int:
    """Repeats of a point whose median is known within ±``tolerance`` (95 %) when each repeat
    moves as ``values`` do: the median of n draws scatters by ~1.25 sigma / sqrt(n) (normal
    noise), sigma taken robustly (1.4826 x the median absolute deviation, relative to the
    median: one slow reading does not set it)."""
    mid = statistics.median(values)
    sigma = 1.4826 * statistics.median(abs(v - mid) for v in values) / mid
    return max(1, math.ceil((1.96 * 1.2533 * sigma / tolerance) ** 2))


def host_check(
    readings: dict[str, list[float]], tolerance: float, repeats: int, per_pass: int
) -> str:
    """The line the study prints first (`host_readings`): each probe's range, and where one
    spreads beyond ``tolerance`` of its median, that the verdict will be weak and how many
    repeats a point would need (`repeats_needed`, against this run's ``repeats``; ``--passes``
    scales them by ``per_pass``)."""
    parts, moved, need = [], False, 1
    for key, what, unit, fmt in HOST_PROBES:
        values = readings.get(key)
        if not values:
            continue
        got = min(values), max(values), statistics.median(values)
        moved |= _beyond(*got, tolerance)
        need = max(need, repeats_needed(values, tolerance))
        parts.append(_probe_text(what, unit, fmt, *got))
    if not parts:
        return ""
    count = max(len(v) for v in readings.values())
    line = f"host check: {count} readings before the study, " + ", ".join(parts)
    if not moved:
        return line + f": held within ±{tolerance:.0%}"
    line += f": moved beyond ±{tolerance:.0%}, so the verdict will be weak (noisy points are "
    line += f"inconclusive); a point's median needs ~{need} repeats to be known within "
    line += f"±{tolerance:.0%} (95 %), this run takes {repeats}"
    if need > repeats:
        line += f": --passes {math.ceil(need / per_pass)}"
    return line


def stats_counters(llms: list[LLM]) -> tuple[float, list[float]]:
    """(attention ranks' seconds in collectives, tokens served per expert rank), cumulative."""
    comm, served = 0.0, []
    for llm in llms:
        for s in llm.stats():
            if s["role"] == "attention" and s.get("comm"):
                comm += sum(s["comm"]["total"]["seconds"].values())
            if s["role"] == "expert":
                served.append(float(s.get("tokens_served", 0)))
    return comm, served


def run_point(llms: list[LLM], topo: Topology, num_requests: int, rate: float, args, rng):
    """Submits ``num_requests`` requests (all at once, or Poisson at ``rate``) spread over the
    replicas; returns the ServingMetrics-like dict of the point."""
    vocab = llms[0].config.model.vocab_size
    prompts = [
        [rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(num_requests)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        if rate != math.inf:
            t += rng.expovariate(rate)
    comm0, served0 = stats_counters(llms)
    for llm in llms:
        llm.reset_metrics()
    host, wake = host_probe(), wake_probe()
    start = time.perf_counter()
    start_wall = time.time()
    outputs, pending, nxt = [], 0, 0
    while nxt < len(prompts) or pending:
        now = time.perf_counter() - start
        due = []
        while nxt < len(prompts) and arrivals[nxt] <= now:
            due.append(nxt)
            nxt += 1
        # round-robin over replicas, what is due in one call per replica (a closed batch
        # arrives at once: submitted one by one, its first requests start a step alone and
        # the rest prefill a step later)
        for k, llm in enumerate(llms):
            mine = [prompts[i] for i in due if i % len(llms) == k]
            if mine:
                llm.submit(mine, params)
                pending += len(mine)
        wait = 0.02 if nxt >= len(prompts) else max(0.0, min(0.02, arrivals[nxt] - now))
        for llm in llms:
            for out, _ in llm.poll(timeout=wait / len(llms)):
                if out.finished:
                    outputs.append(out)
                    pending -= 1
    end = max(o.metrics.arrival_time + o.metrics.e2e_latency for o in outputs)
    records = [llm.step_records for llm in llms]
    steps = [s for recs in records for s in recs]
    m = summarize(outputs, steps, end - start_wall)
    comm1, served1 = stats_counters(llms)
    served = [b - a for a, b in zip(served0, served1)]
    imbalance = max(served) / statistics.fmean(served) if served and sum(served) else 1.0
    busy = topo.attention_ranks * topo.replicas * m.duration_s
    return dict(
        duration_s=m.duration_s,
        output_tok_s=m.output_tok_s,
        ttft_p50_ms=m.ttft_p50 * 1e3,
        ttft_p90_ms=m.ttft_p90 * 1e3,
        ttft_p99_ms=m.ttft_p99 * 1e3,
        tbt_p50_ms=m.tbt_p50 * 1e3,
        tbt_p90_ms=m.tbt_p90 * 1e3,
        tbt_p99_ms=m.tbt_p99 * 1e3,
        tpot_mean_ms=m.tpot_mean * 1e3,
        step_p50_ms=decode_step_time(records, m.tbt_p50) * 1e3,
        load_avg=os.getloadavg()[0],
        host_gb_s=host,
        **({} if wake is None else {"host_wake_us": wake}),
        comm_share=(comm1 - comm0) / busy if busy else 0.0,
        imbalance=imbalance,
        seqs_per_step_mean=m.seqs_per_step_mean,
    )


def median_dict(runs: list[dict]) -> dict:
    """Per-key median over repeats (throughput and latencies alike), and the range of the step
    time and throughput over the repeats (how far the machine moved them)."""
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    for key, field in (("step", "step_p50_ms"), ("output_tok_s", "output_tok_s")):
        vals = [r[field] for r in runs]
        out[f"{key}_min" + ("_ms" if key == "step" else "")] = min(vals)
        out[f"{key}_max" + ("_ms" if key == "step" else "")] = max(vals)
    for key, *_ in HOST_PROBES:
        if all(key in r for r in runs):
            out[f"{key}_min"] = min(r[key] for r in runs)
            out[f"{key}_max"] = max(r[key] for r in runs)
    return out


def pass_order(topos: list[Topology], i: int, seed: int) -> list[Topology]:
    """The topologies in pass ``i``'s order: as given, then reversed, then shuffled (seeded), so
    each configuration's repeats fall at different times of the study."""
    if i == 0:
        return list(topos)
    if i == 1:
        return topos[::-1]
    order = list(topos)
    random.Random(seed + i).shuffle(order)
    return order


def sweep(
    args, topos: list[Topology], bar: tqdm, batches: dict[Topology, list[int]] | None = None
) -> list[dict]:
    """Every topology x workload point, ``--passes`` times over the whole sweep (so repeats of a
    point are minutes apart, not back to back: the machine's other load changes slowly) and
    ``--repeats`` times per pass; each row keeps the medians. ``batches``: each topology's own
    closed batches (the held-out sweep), instead of ``--batch`` and ``--rate`` for all."""
    every = [(b, math.inf) for b in args.batch] + [(args.num_requests, r) for r in args.rate]

    def points_of(topo: Topology) -> list[tuple[int, float]]:
        return [(b, math.inf) for b in batches[topo]] if batches else every

    rng = random.Random(args.seed)
    runs: dict[tuple[Topology, int], list[dict]] = {}
    failed: dict[Topology, str] = {}
    for pass_i in range(args.passes):
        for topo in pass_order(topos, pass_i, args.seed):
            points = points_of(topo)
            if topo in failed:
                bar.update(len(points))
                continue
            bar.set_description(topo.label())
            llms: list[LLM] = []
            try:
                for _ in range(topo.replicas):
                    llms.append(
                        LLM(
                            args.model,
                            device="cpu",
                            dtype=CALIBRATION_DTYPE,  # (what the simulator's CPU profile models)
                            threads_per_rank=1,
                            max_num_seqs=max(64, *(n for n, _ in points)),
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            timeout_s=120,
                            **topo.llm_kwargs(),
                        )
                    )
                # warm-up: a whole discarded run of each closed batch (or of the first point):
                # a fresh process pays allocation and first-call costs at each new size (an
                # instance's first prefill of a size is slower than the next)
                for n, rate in [p for p in points if p[1] == math.inf] or points[:1]:
                    run_point(llms, topo, n, rate, args, rng)
                for i, (n, rate) in enumerate(points):
                    for _ in range(args.repeats):
                        r = run_point(llms, topo, n, rate, args, rng)
                        runs.setdefault((topo, i), []).append(r)
                    bar.update(1)
            except Exception as e:  # one failing topology must not lose the rest of the study
                tqdm.write(f"{topo.label()}: failed: {str(e).splitlines()[0]}")
                failed[topo] = f"failed: {type(e).__name__}"
                bar.update(len(points) - sum((topo, i) in runs for i in range(len(points))))
            finally:
                for llm in llms:
                    llm.close()
    rows = []
    for topo in topos:
        base = dict(
            attention_ranks=topo.attention_ranks,
            expert_ranks=topo.expert_ranks,
            ranks=topo.ranks,
            replicas=topo.replicas,
            transport=topo.transport if topo.expert_ranks else "none",
            micro_batches=topo.micro_batches,
            balancer=topo.balancer,
            redundant_experts=topo.redundant_experts if topo.balancer != "static" else 0,
            prompt_len=args.prompt_len,
            max_tokens=args.max_tokens,
            max_num_batched_tokens=args.max_num_batched_tokens,
            cores=usable_cores(),
        )
        for i, (n, rate) in enumerate(points_of(topo)):
            measured = runs.get((topo, i))
            if not measured:
                rows.append({**base, "status": failed.get(topo, "not run"), "num_requests": n,
                             "rate": rate})  # fmt: skip
                continue
            m = median_dict(measured)
            m["output_tok_s_per_rank"] = m["output_tok_s"] / (topo.ranks * topo.replicas)
            rows.append(
                {**base, "status": "ok", "num_requests": n, "rate": rate,
                 "repeats": len(measured), **m}
            )  # fmt: skip
    return rows


# ---- outputs ----------------------------------------------------------------------------------
def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(r.get(k, "")) for k in FIELDS})


def _fmt(v):
    if isinstance(v, float):
        return "inf" if v == math.inf else f"{v:.6g}"
    return v


SWEEP_AXES = (
    ("attention_ranks", "attention ranks"),
    ("expert_ranks", "expert ranks"),
    ("num_requests", "batch (closed-batch requests)"),
    ("rate", "request rate (req/s)"),
    ("micro_batches", "micro-batches"),
    ("transport", "transport"),
    ("balancer", "balancer"),
    ("replicas", "replicas"),
)


def write_plots(rows: list[dict], out: Path, notes: list[str]) -> list[Path]:
    """One figure per swept axis: output tokens/s per rank and latency (TBT p50, TTFT p50)
    against it, one line per setting of the other axes; and predicted vs measured."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        notes.append("plots skipped: matplotlib is not installed (pip install matplotlib)")
        return []
    ok = [r for r in rows if r["status"] == "ok"]
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for axis, title in SWEEP_AXES:
        pool = [r for r in ok if (axis == "rate") == (r["rate"] != math.inf)]
        if axis == "num_requests":
            pool = [r for r in ok if r["rate"] == math.inf]
        if axis in ("transport", "balancer", "micro_batches"):
            pool = [r for r in pool if r["expert_ranks"]]  # colocated runs have none of these
        values = sorted(
            {r[axis] for r in pool}, key=str if axis in ("transport", "balancer") else float
        )
        if len(values) < 2:
            continue
        others = [a for a, _ in SWEEP_AXES if a not in (axis, "rate", "num_requests")]
        if axis not in ("num_requests", "rate"):
            others.append("num_requests" if pool and pool[0]["rate"] == math.inf else "rate")
        groups: dict[tuple, list[dict]] = {}
        for r in pool:
            # colocated runs (transport "none") sit on the flat transport's lines
            key = tuple("flat" if a == "transport" and r[a] == "none" else r[a] for a in others)
            groups.setdefault(key, []).append(r)
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for key, rs in sorted(groups.items(), key=lambda kv: str(kv[0])):
            if len(rs) < 2:
                continue
            rs = sorted(rs, key=lambda r: values.index(r[axis]))
            xs = [values.index(r[axis]) for r in rs]
            label = _group_label(dict(zip(others, key)))
            ax1.plot(xs, [r["output_tok_s_per_rank"] for r in rs], marker="o", label=label)
            (line,) = ax2.plot(xs, [r["tbt_p50_ms"] for r in rs], marker="o", label=label)
            ax2.plot(
                xs, [r["ttft_p50_ms"] for r in rs], marker="x", ls="--", color=line.get_color()
            )
        for ax, ylabel in (
            (ax1, "output tokens/s per rank"),
            (ax2, "TBT p50 (solid) / TTFT p50 (dashed), ms"),
        ):
            ax.set_xticks(range(len(values)), [str(v) for v in values])
            ax.set_xlabel(title)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        ax2.set_yscale("log")
        handles, labels = ax1.get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=7)
        fig.suptitle(f"splitmoe on this machine: throughput per rank and latency vs {title}")
        fig.tight_layout(rect=(0, 0.12 if handles else 0, 1, 1))
        path = out / f"scaling_{axis}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    pred = [r for r in ok if r.get("pred_output_tok_s") not in (None, "")]
    if pred:
        fig, ax = plt.subplots(figsize=(5.2, 5))
        for use, marker, label in (
            ("validation", "o", "validation runs"),
            ("calibration", "s", "calibration runs"),
            ("oversubscribed", "x", "oversubscribed (not counted)"),
        ):
            sel = [r for r in pred if _use(r) == use]
            if not sel:
                continue
            ax.scatter(
                [r["output_tok_s"] for r in sel],
                [r["pred_output_tok_s"] for r in sel],
                marker=marker,
                label=label,
            )
            for r in sel:
                ax.annotate(
                    f"{r['attention_ranks']}+{r['expert_ranks']} b{r['num_requests']}",
                    (r["output_tok_s"], r["pred_output_tok_s"]),
                    fontsize=6,
                )
        lo = min(min(r["output_tok_s"], r["pred_output_tok_s"]) for r in pred) * 0.7
        hi = max(max(r["output_tok_s"], r["pred_output_tok_s"]) for r in pred) * 1.3
        xs = [lo, hi]
        ax.plot(xs, xs, color="k", lw=0.8)
        ax.fill_between(
            xs, [x * 0.85 for x in xs], [x * 1.15 for x in xs], alpha=0.15, label="±15%"
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured output tokens/s")
        ax.set_ylabel("simulated output tokens/s")
        ax.legend(fontsize=8)
        ax.set_title("simulator vs measured (this machine)")
        fig.tight_layout()
        path = out / "scaling_validation.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _use(r: dict) -> str:
    """What a predicted row is to the check: calibration, oversubscribed, or validation."""
    if r.get("calibration"):
        return "calibration"
    return "oversubscribed" if r.get("verdict") == "oversubscribed" else "validation"


def _group_label(d: dict) -> str:
    parts = []
    if "attention_ranks" in d and "expert_ranks" in d:
        parts.append(f"{d['attention_ranks']}A+{d['expert_ranks']}E")
    elif "attention_ranks" in d:
        parts.append(f"A={d['attention_ranks']}")
    elif "expert_ranks" in d:
        parts.append(f"E={d['expert_ranks']}")
    if d.get("transport") not in (None, "none", "flat"):
        parts.append(d["transport"])
    if d.get("micro_batches", 1) != 1:
        parts.append(f"m={d['micro_batches']}")
    if d.get("balancer", "static") != "static":
        parts.append(d["balancer"])
    if d.get("replicas", 1) != 1:
        parts.append(f"x{d['replicas']}")
    if "num_requests" in d:
        parts.append(f"batch {d['num_requests']}")
    if "rate" in d:
        parts.append(f"rate {d['rate']}")
    return " ".join(parts)


# ---- main -------------------------------------------------------------------------------------
def read_csv(path: Path) -> list[dict]:
    """Rows of an earlier ``scaling.csv`` with their numbers parsed back."""
    rows = []
    for r in csv.DictReader(path.open()):
        row = {}
        for k, v in r.items():
            if v in ("", None) or k in ("status", "transport", "balancer", "verdict"):
                row[k] = v
            elif k == "calibration":
                row[k] = v == "True"
            else:
                x = float(v)
                row[k] = int(x) if x.is_integer() and k not in FLOAT_FIELDS else x
        rows.append(row)
    return rows


FLOAT_FIELDS = {"rate", "load_avg"} | {
    f for f in FIELDS if f.endswith(("_ms", "_s", "share", "imbalance", "_min", "_max"))
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the built-in model)")
    ap.add_argument("--out", default="out/scaling")
    ap.add_argument("--quick", action="store_true", help="small preset: a few minutes on 2 cores")
    ap.add_argument("--attention-ranks", type=csv_list(int), default=[1, 2, 4])
    ap.add_argument("--expert-ranks", type=csv_list(int), default=[0, 1, 2])
    ap.add_argument("--batch", type=csv_list(int), default=[1, 8, 32], help="closed batches")
    ap.add_argument("--rate", type=csv_list(rate_value), default=[], help="req/s (Poisson)")
    ap.add_argument("--num-requests", type=int, default=64, help="requests per rate point")
    ap.add_argument("--micro-batches", type=csv_list(int), default=[1, 2])
    ap.add_argument("--transport", type=csv_list(str), default=["flat", "two_phase"])
    ap.add_argument("--balancer", type=csv_list(str), default=["static", "global"])
    ap.add_argument("--redundant-experts", type=int, default=4)
    ap.add_argument("--replicas", type=csv_list(int), default=[1])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2, help="runs per point and pass")
    ap.add_argument("--passes", type=int, default=None, help="times over the whole sweep "
                    "(default 2; 5 with --quick and --held-out)")  # fmt: skip
    ap.add_argument("--max-processes", type=int, default=6, help="skip bigger topologies")
    ap.add_argument("--validate", action=argparse.BooleanOptionalAction, default=None,
                    help="calibrate this machine first, then check the simulator (default: on "
                    "with --quick)")  # fmt: skip
    ap.add_argument("--profile", default=None, help="use this CPU profile instead of calibrating")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from-csv", default=None, help="redo plots (and the check with --profile) "
                    "from an earlier scaling.csv instead of running")  # fmt: skip
    ap.add_argument("--held-out", action="store_true", help="the held-out check (issue 41): "
                    "calibration runs and the 16 held-out points of the realistic preset, "
                    "exit 1 below 15 within ±15%%")  # fmt: skip
    ap.add_argument("--held-out-batches", type=csv_list(int), default=None,
                    help="with --held-out: the two closed batches of the 16 points (default "
                    "8,32); a new set for a model that has seen the last one")  # fmt: skip
    args = ap.parse_args(argv)
    if args.held_out and args.quick:
        ap.error("--held-out and --quick are different sweeps: pass one")
    if args.held_out_batches is not None:
        from splitmoe.sim.calibrate import CALIBRATION_RUNS

        b, used = args.held_out_batches, sorted({r[2] for r in CALIBRATION_RUNS})
        if not args.held_out:
            ap.error("--held-out-batches goes with --held-out")
        if len(set(b)) != 2 or min(b) < 2 or set(used) & set(b):
            ap.error(f"--held-out-batches: two batches of 2 or more that no calibration run "
                     f"uses (they use {used}), got {b}")  # fmt: skip
    if args.held_out:
        from splitmoe.sim.calibrate import CALIBRATION_PROMPT, CALIBRATION_TOKENS

        # the calibration runs' workload; every other sweep option is the plan's
        args.prompt_len, args.max_tokens, args.rate = CALIBRATION_PROMPT, CALIBRATION_TOKENS, []
        args.repeats, args.validate = 1, True
    if args.quick:
        args.attention_ranks, args.expert_ranks = [1, 2], [0, 1, 2]
        args.batch, args.rate = [1, 16], []
        args.micro_batches, args.transport, args.balancer = [1, 2], ["flat"], ["static", "global"]
        args.replicas, args.repeats = [1], 1
    args.passes = args.passes or (5 if args.held_out or args.quick else 2)
    if args.validate is None:
        args.validate = args.quick
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.model:  # (the held-out sweep's preset is the realistic one)
        args.model = realistic_model_path() if args.held_out else default_model_path()
    out = Path(args.out)
    runs = held_out_set(args)  # (None without --held-out)
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    if args.from_csv:
        rows, check = read_csv(Path(args.from_csv)), None
        if args.profile:
            from splitmoe.sim.hardware import load_profile

            check, _ = validate(args, load_profile(args.profile), rows, out)
            by_key = {id_key(r): r for r in check.rows}
            rows = [by_key.get(id_key(r), r) for r in rows]
            print(check.table())
            print(host_text(check.rows), end="")
        write_csv(rows, out / "scaling.csv")
        for p in write_plots(rows, out / "plots", notes):
            print(f"plot: {p}")
        if check is not None:
            print(held_out_line(check, runs) if runs else check.verdict())  # last, as in a run
        return exit_code(check, runs)
    batches = None
    if args.held_out:
        topos, batches = held_out_plan(runs)
        print(frozen_model())
    else:
        topos = plan_topologies(args, notes)
    cfg = ModelConfig.from_hf(args.model)
    for n in notes:
        print(f"note: {n}")
    if args.validate or args.profile:
        from splitmoe.sim.validate import TOLERANCE

        # first, before the minutes of runs: whether this host can hold a point within the check
        print(host_check(host_readings(), TOLERANCE, args.passes * args.repeats, args.repeats))
    hw = None
    if args.profile:
        from splitmoe.sim.hardware import load_profile

        hw = load_profile(args.profile)
    elif args.validate:
        from splitmoe.sim.calibrate import measure_hardware

        # The step-level constants are fitted below from this sweep's own calibration runs
        # (`CALIBRATION_RUNS`), measured in the same passes as the runs they are checked on.
        print("measuring this machine's roofline and component overheads ...")
        hw = measure_hardware(args.model, log=print)
    per_topo = [len(batches[t]) if batches else len(args.batch) + len(args.rate) for t in topos]
    total = sum(per_topo) * args.passes
    print(
        f"{len(topos)} topologies, {sum(per_topo)} workload points, "
        f"model {cfg.model_type} ({cfg.num_layers} layers, {cfg.num_experts} experts, "
        f"top-{cfg.top_k}), {usable_cores()} cores"
    )
    t0 = time.time()
    with tqdm(total=total, unit="point", file=sys.stdout, mininterval=1.0) as bar:
        rows = sweep(args, topos, bar, batches)
    write_csv(rows, out / "scaling.csv")  # before anything else can fail
    check = None
    if hw is not None:
        check, hw = validate(args, hw, rows, out)
        by_key = {id_key(r): r for r in check.rows}
        rows = [by_key.get(id_key(r), r) for r in rows]
    write_csv(rows, out / "scaling.csv")
    plots = write_plots(rows, out / "plots", notes)
    summary = [
        f"{len(rows)} run points in {time.time() - t0:.0f} s -> {out / 'scaling.csv'}",
        *(f"plot: {p}" for p in plots),
        *(f"note: {n}" for n in notes),
    ]
    (out / "notes.txt").write_text("\n".join(notes) + ("\n" if notes else ""))
    print("\n" + table(rows))
    verdict = None
    if check is not None:
        verdict = held_out_line(check, runs) if runs else check.verdict()
        if args.held_out:
            verdict = frozen_model() + "\n" + verdict
        text = check.table() + "\n" + host_text(check.rows) + verdict
        (out / "validation.txt").write_text(text + "\n")
        print("\nsimulator vs measured (closed batches):\n" + text)
    print("\n" + "\n".join(summary))
    if verdict is not None:
        print(verdict)  # last, where a reader of the log looks
    return exit_code(check, runs)


def host_text(rows: list[dict]) -> str:
    """`host_line` at the check's tolerance and a newline, or "" for rows without probes."""
    from splitmoe.sim.validate import TOLERANCE

    line = host_line(rows, TOLERANCE)
    return line + "\n" if line else ""


def held_out_set(args) -> tuple | None:
    """The held-out points of this run (`held_out_runs` at ``--held-out-batches``), or None
    without ``--held-out``."""
    from splitmoe.sim.validate import HELD_OUT_BATCHES, held_out_runs

    if not args.held_out:
        return None
    return held_out_runs(tuple(args.held_out_batches or HELD_OUT_BATCHES))


def held_out_line(check, runs: tuple) -> str:
    from splitmoe.sim.validate import held_out

    return held_out(check, runs).line


def exit_code(check, held_out_runs: tuple | None = None) -> int:
    """The study's exit status (`splitmoe.sim.validate.Outcome`): 0 without a check or when the
    model held on the decidable points, 2 when too few points were decidable (the host was too
    noisy to judge), 1 when decidable points missed or there was nothing to check. The check
    asks every decidable validation point to hit (`Check.outcome`); the held-out check (the
    points ``held_out_runs``) `HELD_OUT_PASS` of every 16 (`held_out`)."""
    if check is None:
        return 0
    if held_out_runs:
        from splitmoe.sim.validate import held_out

        return held_out(check, held_out_runs).outcome.exit_status
    return check.outcome().exit_status


def validate(args, hw, rows: list[dict], out: Path):
    """Fits the profile's step-level constants on the sweep's calibration runs (unless a
    ``--profile`` was given), writes it, and checks the simulator on every other closed batch
    (outside the held-out check, those whose rank processes each had a core: `recorded_cores`)."""
    from splitmoe.sim.calibrate import CALIBRATION_PROMPT, CALIBRATION_RUNS, CALIBRATION_TOKENS
    from splitmoe.sim.calibrate import calibrate as calibrate_profile
    from splitmoe.sim.model import ModelShape
    from splitmoe.sim.validate import check as run_check
    from splitmoe.sim.validate import measured_step_ms, predictable

    shape = ModelShape.from_config(args.model)
    calib: set = set()
    if not args.profile:
        same = args.prompt_len == CALIBRATION_PROMPT and args.max_tokens == CALIBRATION_TOKENS
        tbt = {
            run_key(r): measured_step_ms(r) / 1e3
            for r in rows
            if same
            and predictable(r)
            and r["balancer"] == "static"
            and r["transport"] in ("none", "flat")
            and run_key(r) in CALIBRATION_RUNS
        }
        missing = set(CALIBRATION_RUNS) - set(tbt)
        if missing:
            print(f"calibration runs missing from the sweep, measuring them: {sorted(missing)}")
        hw = (
            calibrate_profile(args.model, max(r["ranks"] for r in rows), None, log=print)
            if (missing)
            else _fit(shape, hw, tbt, args.model)
        )
        calib = set(tbt)
        hw.to_file(out / "cpu_profile.json")
    elif getattr(args, "held_out", False):
        calib = set(CALIBRATION_RUNS)  # (a frozen profile's own runs: not held-out points)
    cores = None if getattr(args, "held_out", False) else recorded_cores(rows)
    return run_check(shape, hw, rows, calib, cores), hw


def recorded_cores(rows: list[dict]) -> int | None:
    """The cores the rows were measured with (`usable_cores`, a ``cores`` column), or None for
    CSVs without it (then no layout is set aside as oversubscribed)."""
    got = [int(r["cores"]) for r in rows if r.get("cores") not in (None, "")]
    return min(got) if got else None


def _fit(shape, hw, tbt, model):
    from splitmoe.sim.calibrate import fit_runs

    fitted = fit_runs(shape, hw, tbt)
    oh = fitted.overheads
    print(
        f"fitted: step {oh.step_s * 1e3:.3f} ms, multi-process {oh.proc_step_s * 1e3:.3f} ms + "
        f"{oh.busy_attention_step_s * 1e3:.3f} ms per further attention rank with work + "
        f"{oh.proc_seq_step_s * 1e3:.3f} ms/seq through expert ranks, "
        f"empty micro-batch {oh.empty_micro_batch_s * 1e6:.0f} us/layer, "
        f"collective {oh.collective(2) * 1e6:.0f} us; ranks sharing cores: wake-up "
        f"{oh.wake_s * 1e6:.0f} us, step boundary {oh.shared_step_s * 1e6:.0f} us per rank "
        f"+ {oh.shared_attention_step_s * 1e6:.0f} per further attention rank, "
        f"per-token work x{fitted.oversubscribed:.2f}"
    )
    return replace(fitted, name="cpu", source={
        "measured_by": "scripts/scaling_study.py --validate", "checkpoint": str(model),
        "runs_step_s": {f"{a}A+{e}E b{b} m={m}": t for (a, e, b, m), t in sorted(tbt.items())},
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": os.getloadavg()[0],
    })  # fmt: skip


def run_key(r: dict) -> tuple[int, int, int, int]:
    """(attention ranks, expert ranks, requests, micro-batches): a `CALIBRATION_RUNS` key."""
    return (r["attention_ranks"], r["expert_ranks"], r["num_requests"], r["micro_batches"])


def id_key(r: dict) -> tuple:
    return tuple(r.get(k) for k in FIELDS[:12])


def table(rows: list[dict]) -> str:
    head = (
        f"{'topology':<30}{'batch/rate':>11}{'tok/s':>9}{'tok/s/rank':>11}{'TTFT p50':>10}"
        f"{'TBT p50':>9}{'TBT p99':>9}{'comm':>7}{'imbal':>7}"
    )
    lines = [head]
    for r in rows:
        topo = (
            f"{r['attention_ranks']}A+{r['expert_ranks']}E {r['transport']} "
            f"m={r['micro_batches']} {r['balancer']} x{r['replicas']}"
        )
        load = f"b{r['num_requests']}" if r["rate"] == math.inf else f"{r['rate']:g}/s"
        if r["status"] != "ok":
            lines.append(f"{topo:<30}{load:>11}  {r['status']}")
            continue
        lines.append(
            f"{topo:<30}{load:>11}{r['output_tok_s']:>9.1f}{r['output_tok_s_per_rank']:>11.1f}"
            f"{r['ttft_p50_ms']:>8.1f}ms{r['tbt_p50_ms']:>7.2f}ms{r['tbt_p99_ms']:>7.2f}ms"
            f"{r['comm_share']:>7.0%}{r['imbalance']:>7.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
