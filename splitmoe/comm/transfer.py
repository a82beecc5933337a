"""Posting a transport's collectives and waiting for them where their data is used.

A transport call posts its collectives on its direction's lane and returns a `Transfer`; how a
lane posts is a `Poster` (`new_poster`): in the caller's thread over shared-memory lanes, on a
communication thread (on CUDA, with a stream of its own) over ``torch.distributed``.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from typing import Any

import torch

from splitmoe.comm.distributed import Collective
from splitmoe.comm.shm_lane import ShmLane


class Transfer:
    """Transfers that one transport call posted and that may still be under way.

    Every call that moves data (`Transport.dispatch`, `combine`, `receive`, `send_back`) posts
    its collectives on its direction's lane and returns at once; what it received is waited for
    where it is used (DeepEP's ``async_finish``: the handle, not the call, blocks). How a lane
    posts (`new_poster`):

    * over ``torch.distributed`` (gloo, NCCL), a communication thread per direction runs the
      lane's collectives in the order they were posted; on CUDA it issues them on a stream of
      its own, after an event recorded on the poster's stream, and `wait` makes the waiter's
      stream wait for the event recorded after them, so the compute stream never waits for
      NCCL it does not need;
    * over shared-memory lanes, sends run at once (a send copies into the peer's ring and never
      waits for the peer unless the ring is full) and receives run when first waited for, in
      posting order.

    ``wait()`` returns what the transfers received (None for sends) and raises what they raised
    (a peer that died, a timeout); ``done()`` says, without blocking, whether they completed:
    for a send over shared memory, whether the peers have read its bytes.
    """

    __slots__ = ("_future", "_run", "_poster", "_value", "_error", "_finished", "_delivered")

    def __init__(
        self,
        *,
        future: Future | None = None,
        run: Callable[[], Any] | None = None,
        poster: _InlinePoster | None = None,
        value: Any = None,
        delivered: Callable[[], bool] | None = None,
    ):
        self._future = future
        self._run = run
        self._poster = poster
        self._value = value
        self._error: BaseException | None = None
        self._finished = future is None and run is None
        self._delivered = delivered

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        if not self._finished:
            return False
        return self._delivered is None or self._delivered()

    def wait(self) -> Any:
        if self._future is not None:
            value, event = self._future.result()
            if event is not None:  # order this thread's stream after the transfers
                event.wait()
                _record_stream(value, torch.cuda.current_stream())
            self._future = None
            self._value, self._finished = value, True
        elif not self._finished:
            self._poster.run_until(self)
        if self._error is not None:
            raise self._error
        return self._value

    def _run_now(self) -> None:
        run, self._run = self._run, None
        try:
            self._value = run()
        except BaseException as e:  # (raised to whoever waits for it)
            self._error = e
        self._finished = True


def _record_stream(value: Any, stream) -> None:
    """Marks the CUDA tensors in ``value`` (nested tuples and lists) as used on ``stream``, so
    the caching allocator does not reuse their memory before that stream is done with it."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            value.record_stream(stream)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _record_stream(v, stream)


class _InlinePoster:
    """Posts on shared-memory lanes, in the caller's thread (their rings are not thread-safe):
    sends run at once, receives when waited for; either way in posting order. ``lane``: the
    direction's exchange with the other role, whose write positions tell `Transfer.done` when
    the peers have read a send."""

    def __init__(self, lane: Collective | None):
        self._deferred: deque[Transfer] = deque()
        self._lane = lane if isinstance(lane, ShmLane) else None

    def post(self, fn: Callable[[], Any], sends: bool, inputs: tuple = ()) -> Transfer:
        if not sends:
            t = Transfer(run=fn, poster=self)
            self._deferred.append(t)
            return t
        self.run_until(None)  # (what was posted before runs first)
        value = fn()
        delivered = None
        if self._lane is not None:
            lane, marks = self._lane, self._lane.write_marks()
            delivered = functools.partial(lane.delivered, marks)
        return Transfer(value=value, delivered=delivered)

    def run_until(self, last: Transfer | None) -> None:
        """Runs the deferred transfers in order, up to ``last`` (all of them for None)."""
        while self._deferred:
            t = self._deferred.popleft()
            t._run_now()
            if t is last:
                return
            if t._error is not None:  # the lane's order is broken: nothing later can run
                self._deferred.clear()
                raise t._error

    def close(self) -> None:
        self._deferred.clear()


class _ThreadPoster:
    """Posts on ``torch.distributed`` lanes: one daemon thread runs the posted functions in
    order (blocking collectives there, none on the caller's thread: gloo's ``async_op`` works
    leaked native memory on torch 2.13). On CUDA the thread issues them on ``stream``."""

    def __init__(self, name: str, stream: Any = None):
        self._name = name
        self._stream = stream
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def post(self, fn: Callable[[], Any], sends: bool, inputs: tuple = ()) -> Transfer:
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # on the poster's stream: the inputs are written when it fires
            _record_stream(inputs, self._stream)
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        future: Future = Future()
        self._queue.put((future, fn, ready))
        return Transfer(future=future)

    def _serve(self) -> None:
        stream = self._stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            while True:
                item = self._queue.get()
                if item is None:
                    return
                future, fn, ready = item
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    if ready is not None:
                        stream.wait_event(ready)
                    value = fn()
                    done = None
                    if stream is not None:
                        done = torch.cuda.Event()
                        done.record(stream)
                    future.set_result((value, done))
                except BaseException as e:
                    future.set_exception(e)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
            self._thread = None


Poster = _InlinePoster | _ThreadPoster


def new_poster(
    direction: str, lane: Collective | None, inline: bool, comm_device: torch.device
) -> Poster:
    """How ``direction``'s transfers are posted (`Transfer`): inline where a shared-memory
    hub exists (``inline``: its rings are not thread-safe, and a lane thread could drain them
    while this thread waits on another lane; a direction that also crosses hosts then blocks on
    its ``torch.distributed`` part), else on a communication thread, on CUDA with a stream of
    its own. ``lane``: the direction's collective."""
    if inline:
        return _InlinePoster(lane)
    stream = None
    if comm_device.type == "cuda":
        stream = torch.cuda.Stream(comm_device)
    return _ThreadPoster(f"splitmoe-{direction}", stream)
