"""Shared-memory collectives (`splitmoe.comm.shm`) against gloo on the same ranks.

Each multi-rank job starts fresh processes (~4 s on 2 cores), so one job runs every check of a
kind and the tests below assert on its results: `_collectives_job` compares `ShmLane` with
``torch.distributed`` over gloo bit for bit, `_failure_job` makes peers diverge, stay silent or
exit and records the errors the waiting rank raised. The engine itself runs once with and once
without shared memory, against the HF reference.
"""

from __future__ import annotations

import glob
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tiny_models import prompt_ids

from splitmoe import LLM, SamplingParams
from splitmoe.comm.distributed import DistGroup, new_collective
from splitmoe.comm.local_job import run_ranks
from splitmoe.comm.shm import ShmHub, ShmLane, host_shm_supported
from splitmoe.config import ParallelConfig

pytestmark = pytest.mark.skipif(
    not host_shm_supported(), reason="shared-memory collectives need x86 Linux with /dev/shm"
)

WORLD = 3
ITERATIONS = 24  # same-lane calls per dtype: catches any mix-up of message order
TINY = 64  # ring bytes of the small lanes: every message below is larger
# (dtype, shape of one row): byte rows of odd width put frame headers across the ring's wrap
ROW_KINDS = [
    (torch.uint8, (37,)),
    (torch.float32, (8,)),
    (torch.int64, ()),
    (torch.bfloat16, (3, 2)),
]


# ---- helpers run inside the ranks ---------------------------------------------------------------
def _data(seed: int, rows: int, dtype: torch.dtype, row: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (rows, *row)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def _garbage(rows: int, dtype: torch.dtype, row: tuple[int, ...]) -> torch.Tensor:
    """An output buffer full of 0x5A bytes, so a row nobody wrote shows up in the comparison."""
    t = torch.empty((rows, *row), dtype=dtype)
    t.view(-1).view(torch.uint8).fill_(0x5A)
    return t


def _split_matrix(seed: int, world: int, max_rows: int) -> list[list[int]]:
    """``S[src][dst]``: rows src sends dst; about a third of them zero."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, max_rows + 1, (world, world), generator=g)
    s[torch.rand(world, world, generator=g) < 0.3] = 0
    return s.tolist()


def _a2a(coll, out, x, recv, send, async_op=False):
    """``all_to_all_single`` on a collective (`ShmLane`, `DistGroup`) or a process group."""
    if isinstance(coll, dist.ProcessGroup):
        return dist.all_to_all_single(out, x, recv, send, group=coll, async_op=async_op)
    return coll.all_to_all_single(out, x, recv, send, async_op=async_op)


def _exchange(coll, seed, split, rank, dtype, row) -> torch.Tensor:
    """``all_to_all_single`` with the rows of ``split`` (``S[src][dst]``, None: equal splits of
    two rows) on ``coll`` (a collective or a process group), from a fresh output buffer."""
    world = len(split) if split is not None else dist.get_world_size()
    send = split[rank] if split is not None else None
    recv = [split[j][rank] for j in range(world)] if split is not None else None
    x = _data(seed * 10 + rank, sum(send) if send else 2 * world, dtype, row)
    out = _garbage(sum(recv) if recv else 2 * world, dtype, row)
    _a2a(coll, out, x, recv, send)
    return out


def _gather(coll, seed, rank, world, dtype, row) -> torch.Tensor:
    x = _data(seed * 10 + rank, 2, dtype, row)
    out = _garbage(2 * world, dtype, row)
    if isinstance(coll, dist.ProcessGroup):
        dist.all_gather_into_tensor(out, x, group=coll)
    else:
        coll.all_gather_single(out, x)
    return out


def _error(fn) -> tuple[str, str, float] | None:
    """(exception type, message, seconds until it was raised), or None if ``fn`` returned."""
    start = time.monotonic()
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return None


def _own_files(hub: ShmHub) -> list[str]:
    return glob.glob(f"/dev/shm/splitmoe-{hub.key}-*")


def _mapped_lanes(pid: int, key: str = "") -> int:
    """How many ``/dev/shm/splitmoe-<key>...`` mappings process ``pid`` holds."""
    with open(f"/proc/{pid}/maps") as f:
        return f.read().count(f"/dev/shm/splitmoe-{key}")


# ---- one job: every collective against gloo ----------------------------------------------------
def _collectives_job(rank: int, world: int) -> dict:
    gloo = dist.group.WORLD
    hub = ShmHub(rank, world, gloo, timedelta(seconds=20))
    everyone = list(range(world))
    a, b = hub.lane(everyone), hub.lane(everyone)
    tiny = hub.lane(everyone, capacity=TINY)
    tiny01 = hub.lane([0, 1], capacity=TINY)  # rank 2 is not a member
    # a hub whose waits poll for SPIN_S before they sleep (ranks with cores of their own)
    spinning = ShmHub(rank, world, gloo, timedelta(seconds=20), spin_s=SPIN_S)
    spin_lane, spin_tiny = spinning.lane(everyone), spinning.lane(everyone, capacity=TINY)
    capped = spinning.lane(everyone, max_spin_s=SPIN_S / 4)
    spins = (a.spin_s, spin_lane.spin_s, capped.spin_s)
    dist.barrier()  # every member has unlinked its inbox
    res: dict = {
        "lane_types": [type(x).__name__ for x in (a, b, tiny, tiny01)],
        "files_after_build": _own_files(hub),
        "spin_s": spins,
        "mapped": _mapped_lanes(os.getpid(), hub.key),
        "pairs": [],  # (case, shared memory result, gloo result)
    }

    def check(case, fn, lane):
        res["pairs"].append((case, fn(lane), fn(gloo)))

    # Uneven splits (zeros included), four row kinds, many calls in a row on two lanes used
    # alternately. Iteration 0: nobody sends anything; 1: rank 1 neither sends nor receives.
    for it in range(ITERATIONS):
        split = _split_matrix(it, world, 6)
        if it == 0:
            split = [[0] * world for _ in range(world)]
        if it == 1:
            for j in range(world):
                split[1][j] = split[j][1] = 0
        for k, (dtype, row) in enumerate(ROW_KINDS):
            seed = 100 * it + k

            def fn(c, seed=seed, split=split, dtype=dtype, row=row):
                return _exchange(c, seed, split, rank, dtype, row)

            check(f"a2a it{it} {dtype} {row}", fn, (a, b)[(it + k) % 2])
        check(
            f"a2a equal splits it{it}",
            lambda c, it=it: _exchange(c, 7000 + it, None, rank, torch.float64, (5,)),
            (a, b)[it % 2],
        )
    # Every message larger than the 64-byte rings, all ranks sending at once.
    for it in range(4):
        split = _split_matrix(500 + it, world, 120)
        for k, (dtype, row) in enumerate(ROW_KINDS[:2]):

            def fn(c, seed=900 + 10 * it + k, split=split, dtype=dtype, row=row):
                return _exchange(c, seed, split, rank, dtype, row)

            check(f"a2a tiny ring it{it} {dtype}", fn, tiny)
    # The same through a spinning hub's lanes: waits that poll, then drain, then sleep.
    for it in range(3):
        split = _split_matrix(600 + it, world, 120 if it else 6)

        def fn(c, seed=1900 + it, split=split):
            return _exchange(c, seed, split, rank, torch.float32, (3,))

        check(f"spinning a2a it{it}", fn, spin_tiny if it else spin_lane)
    # all_to_all_counted (the flat dispatch): rank 0 sends, the others learn their row counts
    # from the frames (an empty frame included), through a roomy and a tiny ring.
    for kind, lane in {"roomy": a, "tiny": tiny}.items():
        for it in range(3):
            rows = _split_matrix(800 + it, world, 120 if "tiny" in kind else 6)[0]
            rows[0] = 0
            if it == 1:
                rows[2] = 0  # rank 2 gets an empty frame
            x = _data(810 + it, sum(rows), torch.float32, (3,))
            got, counts = lane.all_to_all_counted(x if rank == 0 else x[:0], rows, [0])
            want = x[sum(rows[:rank]) : sum(rows[: rank + 1])] if rank else x[:0]
            res["pairs"].append((f"counted {kind} it{it}", got, want))
            res["pairs"].append((f"counted {kind} it{it} rows", torch.tensor(counts),
                                 torch.tensor([rows[rank] if rank else 0, 0, 0])))  # fmt: skip
    # all_gather_single: StepSync's [3] int64 rows, float rows, and through a tiny ring.
    for it, (dtype, row) in enumerate([(torch.int64, (3,)), (torch.float32, (5,))]):
        for lane in (a, b, tiny):

            def fn(c, seed=3000 + it, dtype=dtype, row=row):
                return _gather(c, seed, rank, world, dtype, row)

            check(f"all_gather {dtype} {lane.name}", fn, lane)

    # Ranks 0 and 1 send each other 20 KB through 64-byte rings at the same time: both must
    # drain their inbox while their own send waits for room.
    n = 20_000
    if rank in (0, 1):
        peer = 1 - rank
        x = _data(40 + rank, 2 * n, torch.uint8, ())
        out = _garbage(2 * n, torch.uint8, ())
        tiny01.all_to_all_single(out, x, [n, n], [n, n])
        want = torch.empty_like(out)
        want[rank * n : (rank + 1) * n] = x[rank * n : (rank + 1) * n]
        want[peer * n : (peer + 1) * n] = _data(40 + peer, 2 * n, torch.uint8, ())[
            rank * n : (rank + 1) * n
        ]
        res["pairs"].append(("tiny 2-rank both big", out, want))

    # Progress across lanes: rank 0's send on tiny01 waits for room while rank 1 first waits
    # for rank 0 on `tiny`. Rank 1 must drain tiny01 while it waits there, or neither moves.
    big = _data(60, n, torch.uint8, ())
    empty = torch.empty(0, dtype=torch.uint8)
    if rank == 0:
        tiny01.all_to_all_single(empty, big, [0, 0], [0, n], async_op=True)
    check(
        "tiny while tiny01 is full",
        lambda c: _exchange(c, 61, [[9] * 3] * 3, rank, *ROW_KINDS[0]),
        tiny,
    )
    if rank == 1:
        got = _garbage(n, torch.uint8, ())
        tiny01.all_to_all_single(got, empty, [n, 0], [0, 0])
        res["pairs"].append(("tiny01 drained into staging", got, big))

    # Asynchronous sends: rank 0 only sends (2, 3, 4 rows to ranks 0, 1, 2); the others only
    # receive. The same calls on gloo are the reference.
    def scatter(c):
        dtype, row = ROW_KINDS[1]
        x = _data(70, 9, dtype, row) if rank == 0 else _data(71, 0, dtype, row)
        recv = [[2, 0, 0], [3, 0, 0], [4, 0, 0]][rank]
        send = [2, 3, 4] if rank == 0 else [0, 0, 0]
        out = _garbage(sum(recv), dtype, row)
        work = _a2a(c, out, x, recv, send, async_op=rank == 0)
        if rank == 0:
            res[f"async handle {type(c).__name__}"] = (work.wait(), work.is_completed())
        return out

    check("async sends", scatter, a)
    check(
        "async sends, next call on the lane",
        lambda c: _exchange(c, 72, None, rank, torch.int64, ()),
        a,
    )
    # async_op with rows to receive from another member cannot return early: refused up front,
    # before anything is sent.
    res["async_recv"] = _error(
        lambda: a.all_to_all_single(
            torch.empty(2), torch.empty(2), [0, 1, 1], [0, 1, 1], async_op=True
        )
    )

    # A member on another host: its groups fall back to gloo, the others keep shared memory.
    hub.hosts = [hub.hosts[0], hub.hosts[0], "elsewhere/another-boot"]
    timeout = timedelta(seconds=20)
    whole = new_collective(everyone, hub, timeout)
    near = new_collective([0, 1], hub, timeout)
    far = new_collective([1, 2], hub, timeout)
    res["fallback"] = {
        "whole": type(whole).__name__,
        "near": type(near).__name__,
        "far": type(far).__name__,
        "lane 0+2": hub.lane([0, 2]),
    }
    split = _split_matrix(80, world, 4)
    check("DistGroup fallback", lambda c: _exchange(c, 81, split, rank, torch.float32, (8,)), whole)
    check(
        "DistGroup fallback gather",
        lambda c: _gather(c, 82, rank, world, torch.int64, (3,)),
        whole,
    )

    hub.close()
    spinning.close()
    res["files_at_end"] = _own_files(hub)
    return res


@pytest.fixture(scope="module")
def collectives():
    return run_ranks(_collectives_job, WORLD, timeout=90)


def _mismatches(results, prefix: str) -> tuple[int, list[str]]:
    checked, bad = 0, []
    for rank, r in enumerate(results):
        for case, got, want in r["pairs"]:
            if case.startswith(prefix):
                checked += 1
                if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
                    bad.append(f"rank {rank}, {case}: got {got}, want {want}")
    return checked, bad


def test_all_to_all_matches_gloo(collectives):
    checked, bad = _mismatches(collectives, "a2a ")
    assert checked == WORLD * ITERATIONS * (len(ROW_KINDS) + 1) + WORLD * 4 * 2
    assert not bad, "\n".join(bad[:5])


def test_messages_larger_than_the_ring(collectives):
    for prefix in ("a2a tiny ring", "tiny 2-rank both big", "tiny while", "tiny01 drained"):
        checked, bad = _mismatches(collectives, prefix)
        assert checked, prefix
        assert not bad, "\n".join(bad[:5])


def test_lanes_poll_as_long_as_their_hub_allows(collectives):
    assert all(r["spin_s"] == (0.0, SPIN_S, SPIN_S / 4) for r in collectives)


def test_spinning_hub_matches_gloo(collectives):
    checked, bad = _mismatches(collectives, "spinning a2a")
    assert checked == WORLD * 3
    assert not bad, "\n".join(bad[:5])


def test_counted_all_to_all(collectives):
    checked, bad = _mismatches(collectives, "counted ")
    assert checked == WORLD * 2 * 3 * 2
    assert not bad, "\n".join(bad[:5])


def test_all_gather_matches_gloo(collectives):
    checked, bad = _mismatches(collectives, "all_gather")
    assert checked == WORLD * 2 * 3
    assert not bad, "\n".join(bad[:5])


def test_async_sends(collectives):
    checked, bad = _mismatches(collectives, "async sends")
    assert checked == 2 * WORLD
    assert not bad, "\n".join(bad[:5])
    # the handle behaves as gloo's does
    assert collectives[0]["async handle ShmLane"] == collectives[0]["async handle ProcessGroup"]
    assert collectives[0]["async handle ShmLane"] == (True, True)
    kind, msg, _ = collectives[0]["async_recv"]
    assert kind == "ValueError" and "async_op" in msg


def test_no_files_left_in_dev_shm(collectives):
    for r in collectives:
        assert r["files_after_build"] == []
        assert r["files_at_end"] == []
    # The files did exist under that name: every rank still maps its inbox and its peers'.
    assert all(r["mapped"] > 0 for r in collectives)


def test_lanes_only_between_ranks_sharing_a_host(collectives):
    shm, dist_group, none = ShmLane.__name__, DistGroup.__name__, type(None).__name__
    # hub.lane: members of a lane get it, a non-member (rank 2 of lane [0, 1]) gets None
    assert [r["lane_types"] for r in collectives] == [[shm] * 4, [shm] * 4, [shm] * 3 + [none]]
    # with rank 2 on "another host": only ranks 0 and 1 keep shared memory
    fallbacks = [r["fallback"] for r in collectives]
    assert [f["whole"] for f in fallbacks] == [dist_group] * 3
    assert [f["near"] for f in fallbacks] == [shm, shm, none]
    assert [f["far"] for f in fallbacks] == [none, dist_group, dist_group]
    assert all(f["lane 0+2"] is None for f in fallbacks)
    checked, bad = _mismatches(collectives, "DistGroup fallback")
    assert checked == 2 * WORLD and not bad, "\n".join(bad)


# ---- one job: peers that diverge, stay silent or exit ------------------------------------------
BRIEF_S = 2.0  # the timeout of the hub whose peers are expected to time out
SPIN_S = 0.02  # the spinning hubs' polling before a wait sleeps
STEADY_BYTES = 64 << 10


def _recv_from(lane: ShmLane, src: int, nbytes: int) -> None:
    """Receives ``nbytes`` from member ``src`` of ``lane`` and sends nothing."""
    recv = [0] * lane.size
    recv[src] = nbytes
    out = torch.empty(nbytes, dtype=torch.uint8)
    lane.all_to_all_single(out, torch.empty(0, dtype=torch.uint8), recv, [0] * lane.size)


def _send_to(lane: ShmLane, dst: int, x: torch.Tensor, async_op: bool = False) -> None:
    """Sends the bytes ``x`` to member ``dst`` of ``lane`` and receives nothing."""
    send = [0] * lane.size
    send[dst] = x.numel()
    empty = torch.empty(0, dtype=torch.uint8)
    lane.all_to_all_single(empty, x, [0] * lane.size, send, async_op=async_op)


def _zombie() -> subprocess.Popen:
    """A child process that has exited and that this process has not reaped yet."""
    p = subprocess.Popen([sys.executable, "-c", ""])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with open(f"/proc/{p.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return p
        time.sleep(0.01)
    raise RuntimeError("the child process did not exit")


def _failure_job(rank: int, world: int) -> dict:
    gloo = dist.group.WORLD
    brief = ShmHub(rank, world, gloo, timedelta(seconds=BRIEF_S))
    brisk = ShmHub(rank, world, gloo, timedelta(seconds=1))
    patient = ShmHub(rank, world, gloo, timedelta(seconds=60))
    spinning = ShmHub(rank, world, gloo, timedelta(seconds=BRIEF_S), spin_s=SPIN_S)
    silent = brief.lane([0, 1])
    unreaped = brief.lane([0, 2])
    steady = brisk.lane([0, 1], capacity=TINY)
    diverging = patient.lane([0, 1])
    leaving = patient.lane([0, 1])
    silent_spinning = spinning.lane([0, 2])
    leaving_spinning = spinning.lane([0, 1])
    res: dict = {}
    dist.barrier()

    # Rank 1 waits for rank 0, which sends nothing; meanwhile rank 0 waits for rank 2, whose pid
    # is swapped for that of a process that has exited but is not reaped yet (a zombie).
    if rank == 1:
        res["silent"] = _error(lambda: _recv_from(silent, 0, 8))
    if rank == 2:  # the same, polling before it sleeps
        res["silent spinning"] = _error(lambda: _recv_from(silent_spinning, 0, 8))
    if rank == 0:
        child = _zombie()
        real, brief.pids[2] = brief.pids[2], child.pid
        res["unreaped"] = _error(lambda: _recv_from(unreaped, 1, 8))
        brief.pids[2] = real
        child.wait()
    dist.barrier()

    # One 64 KB message through a 64-byte ring on a hub with a 1 s timeout: for 1.6 s rank 1
    # takes the ring's bytes every 0.1 s (as a rank waiting on another lane does), then receives
    # the message. Rank 0's send sees progress every 0.1 s but takes longer than 1 s in all.
    if rank == 0:
        res["steady send"] = _error(
            lambda: _send_to(steady, 1, torch.ones(STEADY_BYTES, dtype=torch.uint8))
        )
    if rank == 1:
        until = time.monotonic() + 1.6
        while time.monotonic() < until:
            brisk.progress()
            time.sleep(0.1)
        res["steady recv"] = _error(lambda: _recv_from(steady, 0, STEADY_BYTES))
    dist.barrier()

    # Rank 0 sends 8 bytes where rank 1 expects 16.
    if rank == 0:
        _send_to(diverging, 1, torch.ones(8, dtype=torch.uint8), async_op=True)
    if rank == 1:
        res["diverged"] = _error(lambda: _recv_from(diverging, 0, 16))
    dist.barrier()

    # Ranks 1 and 2 exit: rank 2 before it builds lane [0, 2], rank 1 without sending on
    # `leaving`. Rank 0 must not wait for them until the 60 s timeout.
    if rank == 0:
        res["never mapped"] = _error(lambda: patient.lane([0, 2]))
        res["left behind"] = _own_files(patient)
        for path in res["left behind"]:
            os.unlink(path)
        res["exited"] = _error(lambda: _recv_from(leaving, 1, 8))
        res["exited spinning"] = _error(lambda: _recv_from(leaving_spinning, 1, 8))
    return res


@contextmanager
def _reaping():
    """Reaps rank processes as soon as they exit, as `LLM` and torchrun do. `run_ranks` joins
    them only at the end: until then a rank that returned early is a zombie, whose pid still
    answers ``kill(pid, 0)``."""
    stop = threading.Event()

    def loop():
        while not stop.wait(0.02):
            multiprocessing.active_children()  # polls, hence reaps, every exited child

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


@pytest.fixture(scope="module")
def failures():
    with _reaping():
        return run_ranks(_failure_job, WORLD, timeout=90)


def test_diverged_sizes_raise(failures):
    kind, msg, _ = failures[1]["diverged"]
    assert kind == "RuntimeError"
    assert "diverged" in msg and "rank 0 sent 8 bytes" in msg and "16 were expected" in msg


def test_silent_peer_times_out(failures):
    kind, msg, seconds = failures[1]["silent"]
    assert kind == "TimeoutError"
    assert "rank 0 did not send its data" in msg
    assert BRIEF_S <= seconds < BRIEF_S + 3


def test_exited_peer_raises_naming_it(failures):
    # rank 1 returned without sending on a lane rank 0 then waited on
    kind, msg, seconds = failures[0]["exited"]
    assert kind == "RuntimeError"
    assert "rank 1" in msg and "exited" in msg
    assert seconds < 5
    # rank 2 returned without building the lane rank 0 was building with it
    kind, msg, seconds = failures[0]["never mapped"]
    assert kind == "RuntimeError"
    assert "rank 2" in msg and "exited" in msg
    assert seconds < 15  # includes rank 2's own exit


def test_spinning_waits_still_time_out_and_see_exits(failures):
    kind, msg, seconds = failures[2]["silent spinning"]
    assert kind == "TimeoutError" and "rank 0 did not send its data" in msg
    assert BRIEF_S <= seconds < BRIEF_S + 3
    kind, msg, seconds = failures[0]["exited spinning"]
    assert kind == "RuntimeError" and "rank 1" in msg and "exited" in msg
    assert seconds < 5


def test_no_file_left_when_building_a_lane_fails(failures):
    assert failures[0]["left behind"] == []


def test_unreaped_peer_counts_as_exited(failures):
    kind, msg, seconds = failures[0]["unreaped"]
    assert kind == "RuntimeError" and "rank 2" in msg and "exited" in msg
    assert seconds < BRIEF_S


def test_timeout_counts_from_the_last_progress(failures):
    assert failures[0]["steady send"] is None
    assert failures[1]["steady recv"] is None


# ---- the engine ----------------------------------------------------------------------------------
MAX_TOKENS = 12
PROMPTS = [prompt_ids(n, seed=i) for i, n in enumerate((1, 5, 17))]


def test_engine_tokens_same_with_and_without_shared_memory(tiny_ckpt, hf_ref):
    ckpt = tiny_ckpt("qwen3_moe")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens, mapped = {}, {}
    for shared_memory in (False, True):
        with LLM(
            str(ckpt),
            attention_ranks=1,
            expert_ranks=1,
            dtype="float32",
            device="cpu",
            shared_memory=shared_memory,
        ) as llm:
            # which rank processes hold shared-memory lanes (LLM keeps no public list of them)
            mapped[shared_memory] = [_mapped_lanes(pid) > 0 for pid in llm.rank_pids]
            outs = llm.generate(PROMPTS, params)
        tokens[shared_memory] = [list(o.token_ids) for o in outs]
    assert mapped == {False: [False, False], True: [True, True]}
    assert tokens[True] == tokens[False]
    assert tokens[True] == [hf_ref(ckpt, p, MAX_TOKENS) for p in PROMPTS]


def test_shared_memory_option(tmp_path, tiny_ckpt):
    with pytest.raises(ValueError, match="shared_memory"):
        ParallelConfig(shared_memory="yes")
    from splitmoe.launch import LaunchEnv, build_parser, prepare

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_token_ids": [5, 6, 7]}\n')
    env = LaunchEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, launcher="single")
    base = ["--model", str(tiny_ckpt("qwen3_moe")), "--prompts", str(prompts), "--output", "-"]
    for flags, want in (([], True), (["--no-shared-memory"], False)):
        cfg, _, _ = prepare(build_parser().parse_args(base + flags), env)
        assert cfg.parallel.shared_memory is want
