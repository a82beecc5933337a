"""One single-producer single-consumer byte ring of a shared-memory lane (`splitmoe.comm.shm`).

A ring lives in its owner's inbox file: a `HEADER` with the monotonic write position (advanced
only by the source) and read position (advanced only by the owner) on separate cache lines, then
``capacity`` data bytes. The source copies bytes in and then publishes them by moving the write
position (x86's total store order keeps the two in that order); the owner copies them out, from
its staging first (the progress rule: what `Ring.drain_into` moved there while it waited).
"""

from __future__ import annotations

import mmap

import numpy as np

from splitmoe.comm.shm_wait import SPIN, LaneView, Waiter, futex_wake, low32

HEADER = 128  # write position at +0, read position at +64, "attached" flag at +96


class Ring:
    """One SPSC ring inside a mapped inbox: ``pos[0]`` write position, ``pos[8]`` read position,
    ``pos[12]`` attached flag, ``pos[13]`` "the writer sleeps on a full ring" (int64 indices);
    ``data`` the bytes, a numpy view (its slice copies cost far less than torch's on small
    messages). The low 32 bits of each position are its futex word, at ``wpos_addr`` /
    ``rpos_addr`` (little-endian).

    A wait on the ring (`write` on a full one, `read` on an empty one) is a `Waiter` for rank
    ``rank`` of ``lane``, which keeps draining every ring of this rank while it waits."""

    def __init__(self, buf: mmap.mmap, offset: int, capacity: int):
        self.pos = np.frombuffer(buf, dtype=np.int64, count=HEADER // 8, offset=offset)
        self.wpos_addr = self.pos.ctypes.data
        self.rpos_addr = self.wpos_addr + 64
        self.data = np.frombuffer(buf, dtype=np.uint8, count=capacity, offset=offset + HEADER)
        self.capacity = capacity

    def drain_into(self, staged: bytearray) -> None:
        """Moves every byte that has arrived into ``staged`` (the owner's side)."""
        r = int(self.pos[8])
        n = int(self.pos[0]) - r
        if n:
            off = r % self.capacity
            first = min(n, self.capacity - off)
            staged += self.data[off : off + first].tobytes()
            if n > first:
                staged += self.data[: n - first].tobytes()
            self.consumed(r + n)

    def consumed(self, r: int) -> None:
        """Moves the read position to ``r``, waking a writer that sleeps on the full ring."""
        self.pos[8] = r
        if self.pos[13]:  # the writer sleeps on this full ring
            self.pos[13] = 0
            futex_wake(self.rpos_addr)

    def write(self, src: np.ndarray, lane: LaneView, rank: int) -> None:
        """Appends the bytes of ``src`` (uint8, 1-D) to the ring (the source's side; numpy
        views: a slice assignment costs a fraction of a torch ``copy_`` on small messages)."""
        cap, total, done = self.capacity, src.size, 0
        waiter = None
        while done < total:
            w = int(self.pos[0])
            r = int(self.pos[8])
            free = cap - (w - r)
            if free == 0:
                waiter = waiter or Waiter(lane, rank, "read its data")
                if waiter.polls + 1 >= SPIN:
                    futex_wake(self.wpos_addr)  # what was written so far can be read
                    self.pos[13] = 1  # wake me when you read (checked again before sleeping)
                    if int(self.pos[8]) != r:
                        continue
                waiter.pause(self.rpos_addr, low32(r))
                continue
            n = min(free, total - done)
            off = w % cap
            first = min(n, cap - off)
            self.data[off : off + first] = src[done : done + first]
            if n > first:
                self.data[: n - first] = src[done + first : done + n]
            self.pos[0] = w + n  # publishes the bytes (x86: stores are not reordered)
            done += n
            waiter = None  # the peer made room: the timeout counts from now

    def read(self, out: np.ndarray, staged: bytearray, lane: LaneView, rank: int) -> None:
        """Fills ``out`` (uint8, 1-D) with the next bytes (the owner's side): first those in
        ``staged``, then the ring's."""
        cap, total, done = self.capacity, out.size, 0
        waiter = None
        while done < total:
            if staged:
                n = min(len(staged), total - done)
                out[done : done + n] = np.frombuffer(staged, dtype=np.uint8, count=n)
                del staged[:n]
                done += n
                waiter = None
                continue
            r = int(self.pos[8])
            avail = int(self.pos[0]) - r
            if avail == 0:
                waiter = waiter or Waiter(lane, rank, "send its data")
                waiter.pause(self.wpos_addr, low32(r))
                continue
            n = min(avail, total - done)
            off = r % cap
            first = min(n, cap - off)
            out[done : done + first] = self.data[off : off + first]
            if n > first:
                out[done + first : done + n] = self.data[: n - first]
            self.consumed(r + n)
            done += n
            waiter = None  # the peer sent something: the timeout counts from now
