"""Front end <-> rank round trip of one small control message, over the engine's wire.

    python scripts/bench_control.py                  # ipc:// (every rank on this host)
    python scripts/bench_control.py --tcp 127.0.0.1  # tcp:// (a launched job's ranks)

A child process stands in for a rank: a `RankSocket` that answers every command at once. The
front end (`FrontEndSocket`) sends a `protocol.StatsQuery` and waits for the `StatsReply`
(small: a few counters), ``--rounds`` times after ``--warm-up`` rounds; prints the median,
p10 and p99 of the round trip, and the same for a step's output of ``--batch`` requests (one
new token each: what an attention rank sends every decode step). Both processes poll with a
timeout, as the engine does (no busy spinning).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

from splitmoe.engine.protocol import StatsQuery, StatsReply, StepOutput
from splitmoe.engine.transport import FrontEndSocket, RankSocket


def _rank(address: str, token: str, batch: int) -> None:
    sock = RankSocket(address, 0, token)
    step = StepOutput(0, list(range(batch)), [[7]] * batch)
    while True:
        for cmd in sock.receive(1.0):
            if cmd.id < 0:
                sock.close()
                return
            if cmd.id % 2:
                sock.send(StatsReply(cmd.id, 0, {"rank": 0, "kv_blocks_used": 12, "rss_mb": 1.5}))
            else:
                sock.send(step)


def _round_trips(front: FrontEndSocket, n: int, kind: int, first: int) -> list[float]:
    out = []
    for i in range(n):
        qid = first + 2 * i + kind
        t0 = time.perf_counter()
        front.send(0, StatsQuery(qid))
        while not front.receive(1.0)[0]:
            pass
        out.append(time.perf_counter() - t0)
    return out


def _summary(name: str, times: list[float]) -> str:
    us = sorted(t * 1e6 for t in times)
    q = statistics.quantiles(us, n=100)
    return f"{name:28s} median {statistics.median(us):7.1f} us   p10 {q[9]:7.1f}   p99 {q[98]:7.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tcp", default=None, help="bind tcp:// on this host instead of ipc://")
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--warm-up", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32, help="requests in a step's output")
    args = ap.parse_args()
    front = FrontEndSocket(args.tcp)
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_rank, args=(front.address, front.token, args.batch), daemon=True)
    child.start()
    deadline = time.monotonic() + 30
    while not front.send(0, StatsQuery(1)):  # (until its Hello is in)
        front.receive(0.05)
        if time.monotonic() > deadline:
            raise SystemExit("the rank process did not connect")
    while not front.receive(1.0)[0]:
        pass
    _round_trips(front, args.warm_up, 1, 10)
    small = _round_trips(front, args.rounds, 1, 10_000)
    steps = _round_trips(front, args.rounds, 0, 10_000)
    print(f"{front.address.split(':')[0]}://, {args.rounds} rounds")
    print(_summary("stats query -> reply", small))
    print(_summary(f"query -> step of {args.batch} requests", steps))
    front.send(0, StatsQuery(-1))
    child.join(5)
    front.close()


if __name__ == "__main__":
    main()
