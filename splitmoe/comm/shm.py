"""Collectives over shared memory, for the ranks of a group that share one host.

Over loopback TCP, gloo takes ~200 us per ``all_to_all_single`` even for a few bytes (2-core
x86 host, torch 2.13), about ten times the cost of the data it moves at decode batch sizes, and
every MoE layer needs two to three of them per micro-batch. Ranks on one host can instead write
into each other's memory, which is what NVLink buffers are to GPU ranks (DeepEP's intra-node
kernels work the same way): a round trip through shared memory costs ~13 us here.

Layout: a group (a *lane*, `ShmLane`) gives each member an inbox, a file in ``/dev/shm`` holding
one single-producer single-consumer byte ring per source member. A ring has a monotonic write
position (advanced only by the source) and read position (advanced only by the owner) on separate
cache lines, then ``capacity`` data bytes. Every non-empty message is framed by its byte length,
which the receiver checks against what it expects, so diverging collective calls fail loudly
instead of mixing up data. (Zero-size shares carry no frame, so that an asynchronous send needs
nothing from its receivers: a rank that sends bytes where its peer expects none is caught at the
peer's next non-empty receive, not at this call.)

Sends never wait for the receiver unless its ring is full, so `all_to_all_single` with
``async_op=True`` (sends only) returns once the bytes are copied. A rank that must wait (ring
full, or data not there yet) moves whatever has arrived in all its rings into private staging
buffers while it waits, so two ranks sending each other more than a ring holds cannot deadlock
(the progress rule of MPI implementations). Waiting spins ~20 us, then sleeps on a futex on
the position the peer will move (a send always wakes its ring's futex; a reader wakes a writer
that sleeps on a full ring), so a waiting rank leaves its core to the ranks doing the work: on
this 2-core VM, with ranks sharing cores, a spinning waiter slowed the expert rank's compute by
~1.3x. A rank that has cores of its own (the runtime pinned it: ``spin_s``, `OWN_CORE_SPIN_S`)
keeps polling for up to ``spin_s`` before it sleeps, as MPI's busy polling does: waking a
sleeping process costs on the order of 100 us in this VM, twice per layer when attention and
experts take turns. A peer whose process has exited, or that sent nothing for ``timeout``, ends
the wait with an error naming it.

The files are unlinked as soon as every member has mapped them, so nothing is left in
``/dev/shm`` however the job ends. Ordering relies on x86's total store order (data bytes are
written before the position that publishes them); `host_shm_supported` refuses other CPUs.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import platform
import secrets
import socket
import time
from collections.abc import Sequence
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
HEADER = 128  # write position at +0, read position at +64, "attached" flag at +96
DATA_CAPACITY = 4 << 20  # bytes per ring on data lanes: several decode-step messages
CONTROL_CAPACITY = 4 << 10  # bytes per ring on control lanes (a few int64 per step)
COUNTS_CAPACITY = 256 << 10  # per-expert counts of every (layer, micro-batch) of a step
SPIN = 64  # polls (~20 us) before a waiting rank goes to sleep on a futex
# How long a rank with cores of its own polls before it sleeps. 1+1 ranks on 2 cores, batch 32,
# 10-14 alternated rounds against 0: m=1 decoded 1.02-1.35x and m=2 1.0-1.24x as fast (batch 128:
# 1.09x both); the gain is the cost of waking a vCPU, which grows with the host's load.
OWN_CORE_SPIN_S = 0.005
# The control lane's cap: a step-boundary wait longer than this sleeps (one wake-up per step; at
# batch 32 the expert rank's waited 0.3-1 ms), so an idle job's expert rank polls ~4% of its
# core rather than ~7% at the full 5 ms.
CONTROL_SPIN_S = 0.002
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
    once if it differs (the kernel compares under the lock that `_futex_wake` takes, so a wake
    that follows a store is never lost)."""
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, expected, ctypes.byref(timeout))


def _low32(position: int) -> int:
    """The futex word of a position (its low 32 bits, as a signed int32)."""
    return ((position + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)


def _futex_wake(addr: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7FFFFFFF, None)


def host_shm_supported() -> bool:
    """x86 (total store order) Linux with a writable ``/dev/shm``."""
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and os.path.isdir(SHM_DIR)
        and os.access(SHM_DIR, os.W_OK)
    )


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (an exited one that its parent has not reaped yet, a
    zombie, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True  # cannot tell: let the timeout decide
    return state not in ("Z", "X", "x")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie counts as gone)."""
    return _alive(pid)


class _Completed:
    """The work handle of a shared-memory send: done once `all_to_all_single` returns."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Ring:
    """One SPSC ring inside a mapped inbox: ``pos[0]`` write position, ``pos[8]`` read position,
    ``pos[12]`` attached flag, ``pos[13]`` "the writer sleeps on a full ring" (int64 indices);
    ``data`` the bytes, a numpy view (its slice copies cost far less than torch's on small
    messages). The low 32 bits of each position are its futex word, at ``wpos_addr`` /
    ``rpos_addr`` (little-endian)."""

    def __init__(self, buf: mmap.mmap, offset: int, capacity: int):
        self.pos = np.frombuffer(buf, dtype=np.int64, count=HEADER // 8, offset=offset)
        self.wpos_addr = self.pos.ctypes.data
        self.rpos_addr = self.wpos_addr + 64
        self.data = np.frombuffer(buf, dtype=np.uint8, count=capacity, offset=offset + HEADER)
        self.capacity = capacity


class ShmHub:
    """This rank's view of the host: which world ranks share it, their pids, and the job's key
    for naming inbox files. Built collectively (every world rank, same order) over ``group``;
    then `lane` builds the shared-memory collective of any group whose members share a host."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup,
        timeout: timedelta,
        spin_s: float = 0.0,
        watch_all: bool = False,
    ):
        """``spin_s``: how long a wait polls before it sleeps (beyond the first `SPIN` polls);
        more than 0 only for a rank that has its cores to itself. ``watch_all``: a long wait
        also checks every other rank of the host, not only the peer it waits for (fault
        tolerance: a rank waiting on a live peer learns that a third one died, so every
        survivor leaves its step within `LIVENESS_S`)."""
        self.rank = rank
        self.timeout_s = timeout.total_seconds()
        self.spin_s = spin_s
        self.watch_all = watch_all
        key = [secrets.token_hex(6) if rank == 0 else None]
        dist.broadcast_object_list(key, src=0, group=group)
        self.key = key[0]
        # A rank that cannot use shared memory gets a host of its own: it shares no lane.
        host = _host_id() if host_shm_supported() else f"{_host_id()}/no-shm/{rank}"
        mine = (host, os.getpid())
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, mine, group=group)
        self.hosts = [h for h, _ in everyone]
        self.pids = [p for _, p in everyone]
        self.lanes: list[ShmLane] = []
        self._next_lane = 0

    def check_peers(self, what: str) -> None:
        """Raises RuntimeError if a rank of this host has exited (``what``: what this rank was
        waiting for)."""
        for r, (host, pid) in enumerate(zip(self.hosts, self.pids)):
            if r != self.rank and host == self.hosts[self.rank] and not _alive(pid):
                raise RuntimeError(
                    f"rank {self.rank}: rank {r} (pid {pid}) exited while this rank waited "
                    f"for rank(s) to {what}"
                )

    def shares_host(self, ranks: Sequence[int]) -> bool:
        return len({self.hosts[r] for r in ranks}) == 1

    def lane(
        self, ranks: Sequence[int], capacity: int = DATA_CAPACITY, max_spin_s: float | None = None
    ) -> ShmLane | None:
        """The shared-memory collective of ``ranks`` (world ranks, in group order) for members;
        None for non-members or when the ranks do not share a host. Call it on every world rank
        in the same order (lane ids are counted everywhere), like ``dist.new_group``.
        ``max_spin_s``: caps the hub's ``spin_s`` on this lane."""
        if capacity < 64 or capacity % 64:
            raise ValueError(f"shared-memory lane capacity {capacity} must be a multiple of 64")
        lane_id = self._next_lane
        self._next_lane += 1
        ranks = list(ranks)
        if self.rank not in ranks or not self.shares_host(ranks):
            return None
        spin_s = self.spin_s if max_spin_s is None else min(self.spin_s, max_spin_s)
        lane = ShmLane(self, lane_id, ranks, capacity, spin_s)
        self.lanes.append(lane)
        return lane

    def progress(self) -> None:
        """Moves every byte that has arrived in any ring of this rank into staging."""
        for lane in self.lanes:
            lane.drain()

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()
        self.lanes.clear()


class ShmLane:
    """The collectives of one group over shared memory (see the module doc): the same calls,
    arguments and results as ``torch.distributed`` on that group, for CPU tensors."""

    def __init__(self, hub: ShmHub, lane_id: int, ranks: list[int], capacity: int, spin_s: float):
        self.hub = hub
        self.spin_s = spin_s  # (see `ShmHub.lane`)
        self.ranks = ranks
        self.size = len(ranks)
        self.me = ranks.index(hub.rank)
        self.capacity = capacity
        self.name = f"lane {lane_id} (ranks {ranks})"
        stride = HEADER + capacity
        nbytes = stride * self.size
        prefix = f"splitmoe-{hub.key}-{lane_id}-"
        path = os.path.join(SHM_DIR, f"{prefix}{hub.rank}")
        # Created under a temporary name and renamed once it has its full size, so a peer that
        # finds the file can map it at once.
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            own = mmap.mmap(fd, nbytes)
            os.rename(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        self._maps = [own]
        self.inbox = [_Ring(own, i * stride, capacity) for i in range(self.size)]
        self.outbox: list[_Ring | None] = [None] * self.size
        try:
            self._attach(prefix, nbytes, stride)
        finally:
            # Every member holds a mapping (or the lane failed): the name goes either way; the
            # memory lives until the last mapping goes.
            os.unlink(path)
        self.staged = [bytearray() for _ in range(self.size)]
        self._head = np.empty(1, dtype=np.int64)  # a frame's length
        self._head_bytes = self._head.view(np.uint8)

    def _attach(self, prefix: str, nbytes: int, stride: int) -> None:
        """Maps every peer's inbox, then waits until every peer has mapped this one."""
        deadline = time.monotonic() + self.hub.timeout_s
        for j, r in enumerate(self.ranks):
            if j == self.me:
                continue
            peer = os.path.join(SHM_DIR, f"{prefix}{r}")
            while True:
                try:
                    fd = os.open(peer, os.O_RDWR)
                    break
                except FileNotFoundError:
                    self._check_wait(r, deadline, "create its shared-memory inbox")
                    time.sleep(0.001)
            try:
                buf = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
            self._maps.append(buf)
            ring = _Ring(buf, self.me * stride, self.capacity)
            ring.pos[12] = 1  # tell the owner this source has mapped its inbox
            self.outbox[j] = ring
        for j, ring in enumerate(self.inbox):
            while j != self.me and not ring.pos[12]:
                self._check_wait(self.ranks[j], deadline, "map this rank's inbox")
                time.sleep(0.001)

    # ---- waiting ------------------------------------------------------------------------------
    def _check_wait(self, rank: int, deadline: float, what: str) -> None:
        now = time.monotonic()
        if self.hub.watch_all:
            self.hub.check_peers(f"{what} on shared-memory {self.name}")
        pid = self.hub.pids[rank]
        if not _alive(pid):
            raise RuntimeError(
                f"rank {self.hub.rank}: rank {rank} (pid {pid}) exited while this rank waited "
                f"for it to {what} on shared-memory {self.name}"
            )
        if now > deadline:
            raise TimeoutError(
                f"rank {self.hub.rank}: rank {rank} did not {what} on shared-memory {self.name} "
                f"within {self.hub.timeout_s:g} s (timeout_s); it may be stuck or its calls "
                "may have diverged from this rank's"
            )

    class _Waiter:
        """An unsuccessful wait for one peer: spins `SPIN` polls (and on for the lane's
        ``spin_s``), then sleeps on the futex word the peer will change (woken at once when it
        does), draining every ring of this rank between polls past the first `SPIN` and between
        sleeps (the progress rule) and checking the peer's liveness and the timeout."""

        __slots__ = ("lane", "rank", "what", "polls", "start", "next_check")

        def __init__(self, lane: ShmLane, rank: int, what: str):
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
                self.lane._check_wait(self.rank, self.start + self.lane.hub.timeout_s, self.what)

    # ---- rings --------------------------------------------------------------------------------
    def drain(self) -> None:
        for j, ring in enumerate(self.inbox):
            if j == self.me:
                continue
            r = int(ring.pos[8])
            n = int(ring.pos[0]) - r
            if n:
                off = r % ring.capacity
                first = min(n, ring.capacity - off)
                self.staged[j] += ring.data[off : off + first].tobytes()
                if n > first:
                    self.staged[j] += ring.data[: n - first].tobytes()
                self._consumed(ring, r + n)

    @staticmethod
    def _consumed(ring: _Ring, r: int) -> None:
        ring.pos[8] = r
        if ring.pos[13]:  # the writer sleeps on this full ring
            ring.pos[13] = 0
            _futex_wake(ring.rpos_addr)

    def _write(self, j: int, src: np.ndarray) -> None:
        """Appends the bytes of ``src`` (uint8, 1-D) to the ring towards member j (numpy views:
        a slice assignment costs a fraction of a torch ``copy_`` on small messages)."""
        ring = self.outbox[j]
        cap, total, done = ring.capacity, src.size, 0
        waiter = None
        while done < total:
            w = int(ring.pos[0])
            r = int(ring.pos[8])
            free = cap - (w - r)
            if free == 0:
                waiter = waiter or self._Waiter(self, self.ranks[j], "read its data")
                if waiter.polls + 1 >= SPIN:
                    _futex_wake(ring.wpos_addr)  # what was written so far can be read
                    ring.pos[13] = 1  # wake me when you read (checked again before sleeping)
                    if int(ring.pos[8]) != r:
                        continue
                waiter.pause(ring.rpos_addr, _low32(r))
                continue
            n = min(free, total - done)
            off = w % cap
            first = min(n, cap - off)
            ring.data[off : off + first] = src[done : done + first]
            if n > first:
                ring.data[: n - first] = src[done + first : done + n]
            ring.pos[0] = w + n  # publishes the bytes (x86: stores are not reordered)
            done += n
            waiter = None  # the peer made room: the timeout counts from now

    def _read(self, j: int, out: np.ndarray) -> None:
        """Fills ``out`` (uint8, 1-D) with the next bytes from member j."""
        ring, staged = self.inbox[j], self.staged[j]
        cap, total, done = ring.capacity, out.size, 0
        waiter = None
        while done < total:
            if staged:
                n = min(len(staged), total - done)
                out[done : done + n] = np.frombuffer(staged, dtype=np.uint8, count=n)
                del staged[:n]
                done += n
                waiter = None
                continue
            r = int(ring.pos[8])
            avail = int(ring.pos[0]) - r
            if avail == 0:
                waiter = waiter or self._Waiter(self, self.ranks[j], "send its data")
                waiter.pause(ring.wpos_addr, _low32(r))
                continue
            n = min(avail, total - done)
            off = r % cap
            first = min(n, cap - off)
            out[done : done + first] = ring.data[off : off + first]
            if n > first:
                out[done + first : done + n] = ring.data[: n - first]
            self._consumed(ring, r + n)
            done += n
            waiter = None  # the peer sent something: the timeout counts from now

    def send_frame(self, j: int, src: torch.Tensor, start: int, size: int) -> None:
        """Frames bytes ``start .. start + size`` of ``src`` (contiguous) to member j (waiting
        for room as needed); wakes member j once it is all in the ring."""
        self._head[0] = size
        self._write(j, self._head_bytes)
        self._write(j, _flat_bytes(src)[start : start + size])
        _futex_wake(self.outbox[j].wpos_addr)

    def recv_header(self, j: int) -> int:
        """Waits for member j's next frame and takes its header: the frame's byte length (its
        bytes follow: `recv_bytes`)."""
        self._read(j, self._head_bytes)
        return int(self._head[0])

    def recv_bytes(self, j: int, dst: torch.Tensor, start: int, size: int) -> None:
        """Fills bytes ``start .. start + size`` of ``dst`` (contiguous) with the next bytes from
        member j (a frame's, after `recv_header`), waiting for them as needed."""
        self._read(j, _flat_bytes(dst)[start : start + size])

    def recv_frame(self, j: int, dst: torch.Tensor, start: int, size: int) -> None:
        """Fills bytes ``start .. start + size`` of ``dst`` (contiguous) with the next frame from
        member j, which must be ``size`` bytes long."""
        n = self.recv_header(j)
        if n != size:
            raise RuntimeError(
                f"rank {self.hub.rank}: rank {self.ranks[j]} sent {n} bytes on "
                f"shared-memory {self.name} where {size} were expected: the ranks' "
                "collective calls diverged"
            )
        self.recv_bytes(j, dst, start, size)

    # ---- collectives --------------------------------------------------------------------------
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        async_op: bool = False,
    ):
        """``torch.distributed.all_to_all_single`` on this group. Sends to members with a zero
        split, and receives from them, carry nothing. ``async_op`` needs nothing to receive from
        other members (it returns once the sends are copied)."""
        n = self.size
        send = _rows(input, input_split_sizes, n)
        recv = _rows(output, output_split_sizes, n)
        if async_op and any(recv[j][1] for j in range(n) if j != self.me):
            raise ValueError("shared-memory all_to_all_single: async_op only sends")
        src, dst = input.contiguous(), output.contiguous()  # (themselves where contiguous)
        for j in range(n):
            start, size = send[j]
            if j != self.me and size:
                self.send_frame(j, src, start, size)
        start, size = send[self.me]
        rstart, rsize = recv[self.me]
        if rsize != size:
            raise ValueError(f"shared-memory all_to_all_single: {size} bytes to self, {rsize} back")
        if size:
            _flat_bytes(dst)[rstart : rstart + size] = _flat_bytes(src)[start : start + size]
        for j in range(n):
            rstart, rsize = recv[j]
            if j != self.me and rsize:
                self.recv_frame(j, dst, rstart, rsize)
        if dst is not output:  # (a contiguous copy was filled)
            output.copy_(dst)
        return _Completed() if async_op else None

    def all_to_all_counted(
        self, input: torch.Tensor, input_split_sizes: list[int], senders: list[int]
    ) -> tuple[torch.Tensor, list[int]]:
        """Members in ``senders`` send every other member its ``input_split_sizes`` rows of
        ``input``; the others receive them, learning how many from the data: returns the rows
        received (in member order; like ``input`` beyond the first dimension) and how many came
        from each member. Here each share is one frame, an empty one included, so no count
        exchange precedes the data and a sender never waits for its receivers."""
        if self.me in senders:
            src = input.contiguous()
            for j, (start, size) in enumerate(_rows(src, input_split_sizes, self.size)):
                if j not in senders:
                    self.send_frame(j, src, start, size)
            return input[:0], [0] * self.size
        row_bytes = input.element_size() * math.prod(input.shape[1:])
        sizes = [0] * self.size
        for j in senders:  # every sender has a ring of its own: all headers first
            sizes[j] = self.recv_header(j)
            if sizes[j] % row_bytes:
                raise RuntimeError(
                    f"rank {self.hub.rank}: rank {self.ranks[j]} sent {sizes[j]} bytes on "
                    f"shared-memory {self.name}, not whole rows of {row_bytes}: the ranks' calls "
                    "diverged"
                )
        data = torch.empty(sum(sizes), dtype=torch.uint8)
        at = 0
        for j in senders:  # then each payload straight into its place
            self._read(j, data.numpy()[at : at + sizes[j]])
            at += sizes[j]
        rows = [n // row_bytes for n in sizes]
        return data.view(input.dtype).view(-1, *input.shape[1:]), rows

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``torch.distributed.all_gather_into_tensor`` on this group."""
        size = input.numel() * input.element_size()
        src = input.contiguous()
        if not output.is_contiguous() or output.numel() * output.element_size() != size * self.size:
            raise ValueError(
                f"shared-memory all_gather_single: output must be contiguous and hold "
                f"{self.size} x {size} bytes; got {output.numel() * output.element_size()}"
            )
        for j in range(self.size):
            if j != self.me:
                self.send_frame(j, src, 0, size)
        _flat_bytes(output)[self.me * size : (self.me + 1) * size] = _flat_bytes(src)
        for j in range(self.size):
            if j != self.me:
                self.recv_frame(j, output, j * size, size)

    def all_gather_from(
        self, output: torch.Tensor, input: torch.Tensor, senders: Sequence[int]
    ) -> None:
        """`all_gather_single` where only the members in ``senders`` contribute: they send
        ``input`` to every other member, every member receives the senders' shares into
        ``output``'s member rows, and the other rows are zero. A sender waits only for the other
        senders, never for the members that only receive (the two-phase transport's count
        exchange: attention ranks post a layer without waiting for the expert ranks)."""
        size = input.numel() * input.element_size()
        src = input.contiguous()
        if not output.is_contiguous() or output.numel() * output.element_size() != size * self.size:
            raise ValueError(
                f"shared-memory all_gather_from: output must be contiguous and hold "
                f"{self.size} x {size} bytes; got {output.numel() * output.element_size()}"
            )
        out = _flat_bytes(output)
        if self.me in senders:
            for j in range(self.size):
                if j != self.me:
                    self.send_frame(j, src, 0, size)
        for j in range(self.size):
            if j == self.me:
                out[j * size : (j + 1) * size] = _flat_bytes(src) if j in senders else 0
            elif j in senders:
                self.recv_frame(j, output, j * size, size)
            else:
                out[j * size : (j + 1) * size] = 0

    def write_marks(self) -> list[int]:
        """Each outgoing ring's write position now: with `delivered`, whether the peers have
        taken everything this rank sent so far."""
        return [0 if ring is None else int(ring.pos[0]) for ring in self.outbox]

    def delivered(self, marks: list[int]) -> bool:
        """Whether every peer has read (into its ring's reader or its staging) the bytes written
        up to ``marks`` (`write_marks`)."""
        return all(
            ring is None or int(ring.pos[8]) >= mark for ring, mark in zip(self.outbox, marks)
        )

    def close(self) -> None:
        self.inbox = self.outbox = []  # drop the views before unmapping
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # an array still views it; the mapping goes with the process
                pass
        self._maps = []


def _flat_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of ``t`` as a numpy view (of a contiguous copy if ``t`` is not contiguous)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def _rows(t: torch.Tensor, splits: list[int] | None, n: int) -> list[tuple[int, int]]:
    """``(byte offset, byte size)`` of each member's share of ``t``'s first dimension."""
    rows = t.shape[0] if t.dim() else 1
    row_bytes = t.element_size() * (t.numel() // rows if rows else 0)
    if splits is None:
        if rows % n:
            raise ValueError(f"all_to_all_single: {rows} rows do not split evenly over {n} ranks")
        splits = [rows // n] * n
    elif len(splits) != n or sum(splits) != rows:
        raise ValueError(f"all_to_all_single: splits {splits} do not cover {rows} rows")
    out, at = [], 0
    for s in splits:
        out.append((at * row_bytes, s * row_bytes))
        at += s
    return out
