"""`ShmLane`: the collectives of one group of ranks that share a host, over shared memory (see
`splitmoe.comm.shm` for the design).

Each member's inbox file holds one `Ring` per source member (`splitmoe.comm.shm_ring`); a lane
creates its own, maps its peers', and unlinks its file once every peer has mapped it. Messages go
as frames (an int64 byte length, then the bytes) that the receiver checks against what it
expects; the collectives (`ShmLane.all_to_all_single`, ...) are sequences of frames.
"""

from __future__ import annotations

import math
import mmap
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from splitmoe.comm.shm_ring import HEADER, Ring
from splitmoe.comm.shm_wait import HubView, check_wait, futex_wake

SHM_DIR = "/dev/shm"


class _Completed:
    """The work handle of a shared-memory send: done once `all_to_all_single` returns."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class ShmLane:
    """The collectives of one group over shared memory (see the module doc): the same calls,
    arguments and results as ``torch.distributed`` on that group, for CPU tensors."""

    def __init__(self, hub: HubView, lane_id: int, ranks: list[int], capacity: int, spin_s: float):
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
        self.inbox = [Ring(own, i * stride, capacity) for i in range(self.size)]
        self.outbox: list[Ring | None] = [None] * self.size
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
                    check_wait(self.hub, r, deadline, "create its shared-memory inbox", self.name)
                    time.sleep(0.001)
            try:
                buf = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
            self._maps.append(buf)
            ring = Ring(buf, self.me * stride, self.capacity)
            ring.pos[12] = 1  # tell the owner this source has mapped its inbox
            self.outbox[j] = ring
        for j, ring in enumerate(self.inbox):
            while j != self.me and not ring.pos[12]:
                check_wait(self.hub, self.ranks[j], deadline, "map this rank's inbox", self.name)
                time.sleep(0.001)

    # ---- frames -------------------------------------------------------------------------------
    def drain(self) -> None:
        """Moves every byte that has arrived in this lane's rings into staging."""
        for j, ring in enumerate(self.inbox):
            if j != self.me:
                ring.drain_into(self.staged[j])

    def send_frame(self, j: int, src: torch.Tensor, start: int, size: int) -> None:
        """Frames bytes ``start .. start + size`` of ``src`` (contiguous) to member j (waiting
        for room as needed); wakes member j once it is all in the ring."""
        ring, rank = self.outbox[j], self.ranks[j]
        self._head[0] = size
        ring.write(self._head_bytes, self, rank)
        ring.write(_flat_bytes(src)[start : start + size], self, rank)
        futex_wake(ring.wpos_addr)

    def recv_header(self, j: int) -> int:
        """Waits for member j's next frame and takes its header: the frame's byte length (its
        bytes follow: `recv_bytes`)."""
        self.inbox[j].read(self._head_bytes, self.staged[j], self, self.ranks[j])
        return int(self._head[0])

    def recv_bytes(self, j: int, dst: torch.Tensor, start: int, size: int) -> None:
        """Fills bytes ``start .. start + size`` of ``dst`` (contiguous) with the next bytes from
        member j (a frame's, after `recv_header`), waiting for them as needed."""
        out = _flat_bytes(dst)[start : start + size]
        self.inbox[j].read(out, self.staged[j], self, self.ranks[j])

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
            out = data.numpy()[at : at + sizes[j]]
            self.inbox[j].read(out, self.staged[j], self, self.ranks[j])
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
