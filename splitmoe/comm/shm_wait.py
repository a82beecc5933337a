"""How a rank waits on a shared-memory lane (`splitmoe.comm.shm`): it polls, then sleeps on a
futex on the position its peer will move, and checks now and then that the peer still lives.

A waiting rank spins `SPIN` polls, then sleeps on the futex word of that position (its
low 32 bits, `low32`), so that it leaves its core to the ranks doing the work; the peer's store
and `futex_wake` end the sleep at once. A rank that has cores of its own polls on for its lane's
``spin_s`` first. Every `LIVENESS_S` a long wait checks that the peer's process exists
(`process_alive`) and that the lane's timeout has not passed (`check_wait`).
"""

from __future__ import annotations

import ctypes
import time
from typing import Protocol


class HubView(Protocol):
    """What a wait reads of its host's shared-memory hub (`shm.ShmHub`): a protocol, so that
    this module, below the hub's, imports nothing of it."""

    rank: int
    pids: list[int]
    timeout_s: float
    watch_all: bool

    def check_peers(self, where: str) -> None: ...

    def progress(self) -> None: ...


class LaneView(Protocol):
    """What a wait reads of its lane (`shm_lane.ShmLane`)."""

    hub: HubView
    spin_s: float
    name: str


SPIN = 64  # polls (tens of microseconds) before a waiting rank sleeps on a futex
SLEEP_S = (0.001, 0.01)  # futex sleeps: the first 10 ms of a wait, then
LIVENESS_S = 0.5  # how often a long wait checks that the peer's process still exists
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not PRIVATE): the words live in shared files
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_SLEEPS = tuple(_Timespec(0, int(s * 1e9)) for s in SLEEP_S)


def _futex_wait(addr: int, expected: int, timeout: _Timespec) -> None:
    """Sleeps while the int32 at ``addr`` equals ``expected``, at most ``timeout``; returns at
    once if it differs (the kernel compares under the lock that `futex_wake` takes, so a wake
    that follows a store is never lost)."""
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, expected, ctypes.byref(timeout))


def low32(position: int) -> int:
    """The futex word of a position (its low 32 bits, as a signed int32)."""
    return ((position + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)


def futex_wake(addr: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7FFFFFFF, None)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (an exited one that its parent has not
    reaped yet, a zombie, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True  # cannot tell: let the timeout decide
    return state not in ("Z", "X", "x")


def check_wait(hub: HubView, rank: int, deadline: float, what: str, lane: str) -> None:
    """Raises RuntimeError if rank ``rank`` (or, with the hub's ``watch_all``, any rank of this
    host) has exited, TimeoutError if ``deadline`` (`time.monotonic`) has passed. ``what``: what
    this rank waits for the rank to do; ``lane``: the lane's name."""
    now = time.monotonic()
    if hub.watch_all:
        hub.check_peers(f"{what} on shared-memory {lane}")
    pid = hub.pids[rank]
    if not process_alive(pid):
        raise RuntimeError(
            f"rank {hub.rank}: rank {rank} (pid {pid}) exited while this rank waited "
            f"for it to {what} on shared-memory {lane}"
        )
    if now > deadline:
        raise TimeoutError(
            f"rank {hub.rank}: rank {rank} did not {what} on shared-memory {lane} "
            f"within {hub.timeout_s:g} s (timeout_s); it may be stuck or its calls "
            "may have diverged from this rank's"
        )


class Waiter:
    """An unsuccessful wait for one peer: spins `SPIN` polls (and on for the lane's
    ``spin_s``), then sleeps on the futex word the peer will change (woken at once when it
    does), draining every ring of this rank between polls past the first `SPIN` and between
    sleeps (the progress rule) and checking the peer's liveness and the timeout."""

    __slots__ = ("lane", "rank", "what", "polls", "start", "next_check")

    def __init__(self, lane: LaneView, rank: int, what: str):
        self.lane, self.rank, self.what = lane, rank, what
        self.polls = 0
        self.start = 0.0
        self.next_check = 0.0

    def pause(self, addr: int, expected: int) -> None:
        """The int32 at ``addr`` was ``expected`` (nothing to do yet)."""
        self.polls += 1
        if self.polls < SPIN:
            return
        now = time.monotonic()
        if self.polls == SPIN:
            self.start = now
            self.next_check = now + LIVENESS_S
        self.lane.hub.progress()
        waited = now - self.start
        if waited >= self.lane.spin_s:  # (before, a rank with a core of its own polls on)
            _futex_wait(addr, expected, _SLEEPS[0] if waited < 0.01 else _SLEEPS[1])
        if now > self.next_check:
            self.next_check = now + LIVENESS_S
            deadline = self.start + self.lane.hub.timeout_s
            check_wait(self.lane.hub, self.rank, deadline, self.what, self.lane.name)
