"""`agree_membership`: the survivors of a recovery agree on who is left over the job's store,
with no leader, so a rank that never checks in (rank 0 included) is left out after the window
and one that checks in after the decision is told it was (`RankEvicted`). Threads stand in for
the rank processes; each has its own client of one store, as ranks do."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from splitmoe.comm.control import RankEvicted, agree_membership

WINDOW_S = 0.5


@pytest.fixture
def store_port():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server.port
    del server


def _client(port: int) -> dist.Store:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


def _agree(port: int, ranks: dict[int, list[int]], world: int, delay: dict | None = None):
    """Each rank of ``ranks`` (with the ranks it saw exit) agrees in a thread of its own, after
    ``delay[rank]`` s; returns per rank the membership (or the exception) and the seconds it
    took from the start."""
    out: dict[int, tuple[object, float]] = {}
    t0 = time.monotonic()

    def run(rank: int, gone: list[int]) -> None:
        time.sleep((delay or {}).get(rank, 0.0))
        try:
            got = agree_membership(_client(port), 1, rank, world, gone, WINDOW_S)
        except Exception as e:  # (RankEvicted, or a failure the test reports)
            got = e
        out[rank] = (got, time.monotonic() - t0)

    threads = [threading.Thread(target=run, args=item) for item in ranks.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    return out


def test_all_check_in_agree_at_once(store_port):
    out = _agree(store_port, {r: [] for r in range(4)}, 4)
    assert {r: got for r, (got, _) in out.items()} == {r: [0, 1, 2, 3] for r in range(4)}
    assert max(s for _, s in out.values()) < WINDOW_S  # (nobody waited for the window)


def test_a_rank_seen_gone_holds_nobody(store_port):
    out = _agree(store_port, {0: [2], 1: [], 3: []}, 4)
    assert {r: got for r, (got, _) in out.items()} == {r: [0, 1, 3] for r in (0, 1, 3)}
    assert max(s for _, s in out.values()) < WINDOW_S


def test_silent_rank_0_is_left_out_and_evicted_when_it_wakes(store_port):
    """Rank 0 (the lowest, which led the old protocol) stopped: the others agree without it
    after the window; when it wakes and checks in, it learns it was left out."""
    out = _agree(store_port, {1: [], 2: [], 3: []}, 4)
    assert {r: got for r, (got, _) in out.items()} == {r: [1, 2, 3] for r in (1, 2, 3)}
    assert all(WINDOW_S <= s < WINDOW_S + 1.0 for _, s in out.values())
    late = _agree(store_port, {0: []}, 4)
    assert isinstance(late[0][0], RankEvicted)
    assert "left out" in str(late[0][0])


def test_a_late_rank_within_the_window_is_kept(store_port):
    out = _agree(store_port, {r: [] for r in range(3)}, 3, delay={2: WINDOW_S / 3})
    assert {r: got for r, (got, _) in out.items()} == {r: [0, 1, 2] for r in range(3)}
