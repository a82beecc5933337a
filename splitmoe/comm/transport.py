"""Dispatch and combine between attention ranks and expert ranks.

Every MoE layer, each attention rank sends each of its tokens **once per distinct destination
expert rank**, together with the (local expert id, router weight) pairs that rank must apply; each
expert rank returns one weighted partial sum per token; the attention rank adds them.
Bytes per layer are therefore ~ tokens x hidden x distinct destinations, not tokens x top-k.

All ranks call the same collectives in the same order (attention ranks with zero tokens too), so
the pattern never deadlocks. A token travels as one packed byte row: its hidden vector in the model
dtype, then ``k`` int32 local expert ids (-1: served elsewhere) and ``k`` float32 weights, so one
message per (source, destination) carries everything.

`FlatTransport` (one all-to-all per direction) is the baseline and the oracle; the two-phase and
adaptive transports live in `splitmoe.comm.two_phase`; `splitmoe.comm.transports` names them
all. Each accounts its traffic the same way in `CommStats`.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from splitmoe.comm.cost_model import DEFAULT_COST_MODEL, LINK_CLASSES, CostModel
from splitmoe.comm.distributed import Collective, new_collective
from splitmoe.comm.shm import ShmHub, ShmLane
from splitmoe.comm.topology import Topology

DIRECTIONS = ("dispatch", "combine")  # attention -> experts / experts -> attention
# Where a layer's communication time goes: the two-phase scheme's per-layer count all-gather,
# its node-local aggregation (phase 1, both directions), and the exchange with the expert ranks
# (flat's all-to-all, its row counts included, or phase 2).
STAGES = ("counts", "aggregate", "exchange")
SCHEMES = ("flat", "two_phase")
UNKNOWN_LAYER = -1  # calls that did not say which layer they serve


class Transfer:
    """Transfers that one transport call posted and that may still be under way.

    Every call that moves data (`Transport.dispatch`, `combine`, `receive`, `send_back`) posts
    its collectives on its direction's lane and returns at once; what it received is waited for
    where it is used (DeepEP's ``async_finish``: the handle, not the call, blocks). How a lane
    posts (`Transport.poster`):

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


@dataclass
class DispatchHandle:
    """What an attention rank keeps between `dispatch` and `combine` of one layer.

    token_index: ``[P]`` int64, the source token of each sent row (rows are grouped by
        destination rank, in rank order, tokens ascending within a destination).
    send_counts: rows sent to each world rank (zero for attention ranks); the partial sums come
        back with the same counts.
    num_tokens: ``T``, tokens of this rank in the layer.
    layer: the MoE layer (for the statistics; `UNKNOWN_LAYER` if the caller did not say).
    sent: the posted dispatch (`Transfer`); its value is the transport-specific layout of the
        layer (`splitmoe.comm.two_phase.LayerPlan` for the two-phase and adaptive transports;
        None for flat). `combine` waits for it.
    """

    token_index: torch.Tensor
    send_counts: list[int]
    num_tokens: int
    layer: int = UNKNOWN_LAYER
    sent: Transfer | None = None

    def done(self) -> bool:
        """Whether the dispatch has completed: the expert ranks have received its rows."""
        return self.sent is None or self.sent.done()

    @property
    def plan(self) -> Any:
        """The layer's layout (waits for the dispatch)."""
        return None if self.sent is None else self.sent.wait()


class ExpertBatch:
    """Tokens an expert rank receives for one layer, as posted by `Transport.receive`.

    ``received``: the posted receive; its value is ``(rows, recv_counts, plan)``. Every property
    waits for it (`wait` does so explicitly, to time the wait):
    rows: ``[N, row_bytes]`` uint8, the packed rows as they came (`Transport.pack`);
    recv_counts: rows received from each world rank (the partial sums go back with these);
    x: ``[N, H]`` hidden states, expert_ids: ``[N, k]`` int32 *local* expert ids (-1 where the
        slot is served by another rank), weights: ``[N, k]`` float32 router weights, unpacked on
        first use by ``unpack`` (the transport's `Transport.unpack`).
    Rows are in the same order whichever transport carried them: by source attention rank, then
    as that rank sent them. ``layer``: as in `DispatchHandle`; plan: the transport's layout.
    """

    def __init__(
        self,
        received: Transfer,
        unpack: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        layer: int = UNKNOWN_LAYER,
    ):
        self.received = received
        self.unpack = unpack
        self.layer = layer

    def wait(self) -> ExpertBatch:
        self.received.wait()
        return self

    def done(self) -> bool:
        return self.received.done()

    @property
    def rows(self) -> torch.Tensor:
        return self.received.wait()[0]

    @property
    def recv_counts(self) -> list[int]:
        return self.received.wait()[1]

    @property
    def plan(self) -> Any:
        return self.received.wait()[2]

    @functools.cached_property
    def _parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.unpack(self.rows)

    @property
    def x(self) -> torch.Tensor:
        return self._parts[0]

    @property
    def expert_ids(self) -> torch.Tensor:
        return self._parts[1]

    @property
    def weights(self) -> torch.Tensor:
        return self._parts[2]


def _empty_record() -> dict:
    return {
        "calls": 0,
        "schemes": dict.fromkeys(SCHEMES, 0),
        **{d: {c: {"messages": 0, "bytes": 0} for c in LINK_CLASSES} for d in DIRECTIONS},
        "seconds": dict.fromkeys(STAGES, 0.0),
        "predicted_s": dict.fromkeys(SCHEMES, 0.0),
    }


def _add_records(into: dict, rec: dict) -> None:
    for key, value in rec.items():
        if isinstance(value, dict):
            _add_records(into[key], value)
        else:
            into[key] += value


class CommStats:
    """What this rank's transport sent and how long it waited, cumulative since start.

    Kept per MoE layer; within a layer: ``calls`` (dispatch or receive calls, i.e. steps that ran
    the layer), ``schemes`` (calls that used each scheme), per direction and link class the
    messages (non-empty transfers to *another* rank; self-copies are free) and bytes this rank
    sent, ``seconds`` per stage (host wall-clock around each collective; on CUDA it includes the
    count synchronisation but not the asynchronous data copies) and, for the adaptive transport,
    ``predicted_s`` the cost model's per-layer time of each scheme summed over calls.
    """

    def __init__(self) -> None:
        self.layers: dict[int, dict] = {}
        # The communication threads (`Transfer`) record too: a record is created, a time added
        # and the records read under this lock; the message and byte counts of a direction are
        # only ever added by one thread.
        self._lock = threading.Lock()

    def record(self, layer: int) -> dict:
        rec = self.layers.get(layer)
        if rec is None:
            with self._lock:
                rec = self.layers.setdefault(layer, _empty_record())
        return rec

    def add_seconds(self, layer: int, stage: str, seconds: float) -> None:
        rec = self.record(layer)
        with self._lock:
            rec["seconds"][stage] += seconds

    def call(self, layer: int, scheme: str) -> None:
        rec = self.record(layer)
        rec["calls"] += 1
        rec["schemes"][scheme] += 1

    def add(
        self,
        layer: int,
        direction: str,
        counts: list[int],
        row_bytes: int,
        peers: list[int] | range,
        links: list[str],
        rank: int,
    ) -> None:
        """``counts[i]`` rows of ``row_bytes`` sent to world rank ``peers[i]``; ``links[r]`` is
        the link class to world rank ``r``."""
        rec = self.record(layer)[direction]
        for peer, n in zip(peers, counts):
            if n and peer != rank:
                cls = rec[links[peer]]
                cls["messages"] += 1
                cls["bytes"] += n * row_bytes

    @contextmanager
    def timed(self, layer: int, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add_seconds(layer, stage, time.perf_counter() - t0)

    def total(self) -> dict:
        out = _empty_record()
        with self._lock:
            for rec in self.layers.values():
                _add_records(out, rec)
        return out

    @property
    def messages(self) -> int:
        t = self.total()
        return sum(t[d][c]["messages"] for d in DIRECTIONS for c in LINK_CLASSES)

    @property
    def bytes(self) -> int:
        t = self.total()
        return sum(t[d][c]["bytes"] for d in DIRECTIONS for c in LINK_CLASSES)

    def snapshot(self) -> dict:
        """``{"layers": {"<layer>": record}, "total": record}`` (see the class doc), JSON-ready."""
        with self._lock:
            layers = {str(k): _copy(v) for k, v in sorted(self.layers.items())}
        return {"layers": layers, "total": self.total()}


def _copy(rec: dict) -> dict:
    return {k: _copy(v) if isinstance(v, dict) else v for k, v in rec.items()}


class Transport(ABC):
    """Moves tokens attention -> experts and partial sums back, for one layer at a time.

    Attention ranks call `dispatch` then `combine`; expert ranks call `receive` then `send_back`.
    The calls of all ranks for one layer form one collective pattern. ``layer`` (optional) only
    labels the statistics.

    Nothing blocks where it is posted: `dispatch` returns a `DispatchHandle` once its transfers
    are posted, `receive` an `ExpertBatch` whose data is waited for on first use, `send_back`
    returns at once (`flush` waits for the sends); `combine` is where an attention rank waits,
    for the partial sums it returns. Each direction's transfers run in posting order on its
    own lane (`Transfer` says how), so micro-batches interleave freely between the directions.
    """

    name = "base"

    def __init__(
        self,
        topo: Topology,
        group: dist.ProcessGroup,
        comm_device: torch.device,
        hidden_size: int,
        top_k: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        cost_model: CostModel | None = None,
        timeout: timedelta | None = None,
        hub: ShmHub | None = None,
    ):
        """Every transport takes the same arguments. ``cost_model``: link profile for transports
        that choose a scheme per layer (default: NVLink 4 + 400 Gb/s InfiniBand); ``timeout``: for
        process groups a transport creates (default: torch's); ``hub``: carries the collectives
        of ranks that share a host over shared memory (`splitmoe.comm.shm`), instead of
        ``torch.distributed``."""
        self.topo = topo
        self.group = group
        self.comm_device = comm_device
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.dtype = dtype
        self.device = device
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.row_bytes = hidden_size * self.elem + 8 * top_k
        # Routing is by expert *slot* (see `Topology`): the attention side's balancer maps each
        # (token, expert) to a slot holding that expert; without replicas slot id = expert id.
        owner = torch.tensor(topo.slot_owner, dtype=torch.int64, device=device)
        first = torch.cumsum(torch.bincount(owner, minlength=topo.num_expert), 0)
        self.slot_rank = owner  # [S] slot -> expert-rank index
        self.slot_local = (
            torch.arange(owner.numel(), device=device)
            - (first - torch.bincount(owner, minlength=topo.num_expert))[owner]
        )  # [S] slot -> local slot id on its rank
        self._slot_rank_np = self.slot_rank.cpu().numpy()
        self._slot_local_np = self.slot_local.cpu().numpy()
        # link class from this rank to every world rank
        self.links = [
            "intra" if topo.node_of(r) == topo.node else "inter" for r in range(topo.world_size)
        ]
        self.stats = CommStats()
        self.cost_model = cost_model or DEFAULT_COST_MODEL
        self.timeout = timeout
        self.hub = hub
        # One group per direction ("lane"): with micro-batches, dispatches of later micro-batches
        # and combines of earlier ones interleave differently on attention and expert ranks, and
        # collectives on one group must be issued in the same order everywhere. Each lane on its
        # own is in the same (layer, micro-batch) order on every rank.
        # Each lane has a process group of its own: its collectives run on a communication
        # thread (`Transfer`), never interleaved with the control plane's on ``group``.
        world = range(topo.world_size)
        self.lanes: dict[str, Collective] = {
            "dispatch": self.new_lane(world),
            "combine": self.new_lane(world),
        }
        self.posters: dict[str, Poster] = {d: self._poster(d) for d in DIRECTIONS}
        self._sends: list[Transfer] = []  # `send_back`s not yet waited for (`flush`)
        # what the receiving side of an all-to-all sends: made once, not per layer and
        # micro-batch (~1 us each)
        self._zeros = [0] * topo.world_size
        self._no_rows = torch.empty(0, self.row_bytes, dtype=torch.uint8, device=comm_device)
        self._no_sums = torch.empty(0, hidden_size, dtype=dtype)

    def _poster(self, direction: str) -> Poster:
        """How ``direction``'s transfers are posted (`Transfer`): inline where a shared-memory
        hub exists (its rings are not thread-safe, and a lane thread could drain them while this
        thread waits on another lane; a direction that also crosses hosts then blocks on its
        ``torch.distributed`` part), else on a communication thread, on CUDA with a stream of
        its own."""
        if self.hub is not None:
            return _InlinePoster(self.lanes[direction])
        stream = None
        if self.comm_device.type == "cuda":
            stream = torch.cuda.Stream(self.comm_device)
        return _ThreadPoster(f"splitmoe-{direction}", stream)

    def post(
        self, direction: str, fn: Callable[[], Any], sends: bool, inputs: tuple = ()
    ) -> Transfer:
        """Posts ``fn`` (the collectives of one call, in the order every rank runs them) on
        ``direction``'s lane. ``sends``: it only sends (over shared memory it then runs at
        once); ``inputs``: tensors it reads (on CUDA, kept alive for the lane's stream)."""
        return self.posters[direction].post(fn, sends, inputs)

    def close(self) -> None:
        """Stops the communication threads (idle ones: after `flush` and the last `combine`)."""
        for poster in self.posters.values():
            poster.close()

    def new_lane(
        self, ranks: range | list[int], group: dist.ProcessGroup | None = None
    ) -> Collective | None:
        """The collective of ``ranks`` (None on non-members); every world rank calls it, in the
        same order."""
        timeout = self.timeout or dist.default_pg_timeout
        return new_collective(ranks, self.hub, timeout, group=group)

    @abstractmethod
    def dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layer: int = UNKNOWN_LAYER,
    ) -> DispatchHandle:
        """Posts ``x [T, H]`` routed by ``topk_ids / topk_weights [T, k]`` to the expert ranks
        (``topk_ids``: expert *slots*, see `route`) and returns without waiting for them: the
        handle's `DispatchHandle.done` says when they have received."""

    @abstractmethod
    def combine(self, handle: DispatchHandle) -> torch.Tensor:
        """Waits for a dispatched layer's partial sums; returns ``[T, H]`` in the model dtype."""

    @abstractmethod
    def receive(self, layer: int = UNKNOWN_LAYER) -> ExpertBatch:
        """Expert side of `dispatch`: posts the receive of the layer's next micro-batch and
        returns its `ExpertBatch` at once; its data is waited for on first use. Receives run
        in posting order, so a rank may post the next one before it computes this one."""

    def send_back(self, y: torch.Tensor, batch: ExpertBatch) -> None:
        """Expert side of `combine`: ``y [N, H]`` partial sums, one per received row, back to
        the ranks they came from (every transport's last hop is this one all-to-all). Returns
        before the transfer completes, so the expert rank can receive the next micro-batch;
        `flush` waits for all of them."""
        counts = batch.recv_counts
        self._sends.append(
            self.post(
                "combine",
                lambda: self.all_to_all(y, counts, self._zeros, batch.layer, "combine"),
                sends=True,
                inputs=(y,),
            )
        )

    def stats_snapshot(self) -> dict:
        """This rank's cumulative statistics, JSON-serialisable::

            {"rank": int, "role": "attention" | "expert", "node": int, "transport": str,
             "layers": {"<layer>": record, ...}, "total": record}

        record = {"calls": int, "schemes": {"flat": int, "two_phase": int},
                  "dispatch": {"intra": {"messages": int, "bytes": int}, "inter": {...}},
                  "combine":  {"intra": {...}, "inter": {...}},
                  "seconds": {"counts": float, "aggregate": float, "exchange": float},
                  "predicted_s": {"flat": float, "two_phase": float}}

        Messages and bytes are what *this* rank sent (summing over ranks counts each transfer
        once); layer ``"-1"`` collects calls that did not name their layer.
        """
        return {
            "rank": self.topo.rank,
            "role": self.topo.role,
            "node": self.topo.node,
            "transport": self.name,
            **self.stats.snapshot(),
        }

    # ---- packing ------------------------------------------------------------------------------
    def pack(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x [P, H]``, ``ids [P, k]`` int32, ``w [P, k]`` float32 -> ``[P, row_bytes]`` uint8."""
        return torch.cat(
            [x.contiguous().view(torch.uint8), ids.view(torch.uint8), w.view(torch.uint8)], dim=1
        )

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`pack`'s inverse: ``x [N, H]``, ``ids [N, k]`` int32, ``w [N, k]`` float32. On CPU
        they are views into ``rows`` (row stride ``row_bytes``; three copies cost ~10 us a
        message, as much as the rest of receiving it), on other devices contiguous copies."""
        hb, k = self.hidden_size * self.elem, self.top_k
        if rows.device.type == "cpu" and self.row_bytes % 4 == 0 and hb % 4 == 0:
            words = rows.view(torch.int32)  # [N, row_bytes / 4]
            at = hb // 4
            x = rows[:, :hb].view(self.dtype)
            return x, words[:, at : at + k], words[:, at + k :].view(torch.float32)
        x = rows[:, :hb].contiguous().view(self.dtype)  # [N, H]
        ids = rows[:, hb : hb + 4 * k].contiguous().view(torch.int32)  # [N, k]
        w = rows[:, hb + 4 * k :].contiguous().view(torch.float32)  # [N, k]
        return x, ids, w

    def route(
        self, slots: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """One row per (token, distinct destination rank), grouped by destination.

        ``slots [T, k]``: the expert slot serving each (token, expert) (the balancer's choice;
        expert ids when there are no replicas). Returns ``token_index [P]``, local slot ids
        ``[P, k]`` int32 (-1 off-rank), weights ``[P, k]`` float32 and the row count per world
        rank.
        """
        if slots.device.type == "cpu":
            return self._route_numpy(slots, topk_weights)
        return self._route_torch(slots, topk_weights)

    def route_rows(
        self, x: torch.Tensor, slots: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """`route` and `pack`: ``token_index [P]``, the packed rows ``[P, row_bytes]`` grouped
        by destination, and the row count per world rank."""
        token_index, ids, w, counts = self.route(slots, topk_weights)
        return token_index, self.pack(x[token_index], ids, w), counts

    def _route_torch(
        self, slots: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """`route` in torch ops (any device, no loop)."""
        T, E = slots.shape[0], self.topo.num_expert
        dest = self.slot_rank[slots]  # [T, k]
        hit = torch.zeros(E, T, dtype=torch.bool, device=slots.device)
        hit.scatter_(0, dest.t(), True)  # [E, T]
        dest_rank, token_index = hit.nonzero(as_tuple=True)  # [P], sorted by (dest, token)
        on_rank = dest[token_index] == dest_rank[:, None]  # [P, k]
        ids = torch.where(on_rank, self.slot_local[slots[token_index]], -1).to(torch.int32)
        w = topk_weights[token_index].to(torch.float32)
        per_expert_rank = torch.bincount(dest_rank, minlength=E).tolist()
        counts = [0] * self.topo.num_attention + per_expert_rank
        return token_index, ids, w, counts

    def _route_numpy(
        self, slots: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """`route` on CPU tensors, the same steps in numpy: on arrays this small each numpy call
        costs ~1 µs against ~5 µs for torch's, and routing runs once per layer and micro-batch
        (~75 -> ~20 µs at 64 tokens x top-4)."""
        s = slots.numpy()
        T, E = s.shape[0], self.topo.num_expert
        dest = self._slot_rank_np[s]  # [T, k]
        hit = np.zeros((E, T), dtype=bool)
        hit[dest, np.arange(T)[:, None]] = True  # [E, T]
        dest_rank, token_index = np.nonzero(hit)  # [P], sorted by (dest, token)
        on_rank = dest[token_index] == dest_rank[:, None]  # [P, k]
        ids = np.where(on_rank, self._slot_local_np[s[token_index]], -1).astype(np.int32)
        tokens = torch.from_numpy(token_index)
        w = topk_weights.to(torch.float32).index_select(0, tokens)
        counts = [0] * self.topo.num_attention + np.bincount(dest_rank, minlength=E).tolist()
        # (via 1-D: numpy may give an empty [0, k] array strides torch cannot view as bytes)
        return tokens, torch.from_numpy(ids.ravel()).view(-1, s.shape[1]), w, counts

    # ---- data plane ---------------------------------------------------------------------------
    def all_to_all(
        self,
        send: torch.Tensor,
        send_counts: list[int],
        recv_counts: list[int],
        layer: int,
        direction: str,
        stage: str = "exchange",
        group: Collective | None = None,
        peers: list[int] | range | None = None,
    ) -> torch.Tensor:
        """Uneven ``all_to_all_single`` of rows over ``group`` (default: the lane of
        ``direction``, whose members are all world ranks); ``peers[i]`` is the world rank of
        member ``i``. Blocking (call it inside a posted function, `post`); counts the transfer
        in `stats` and returns the received rows on the compute device."""
        send = send.to(self.comm_device)
        recv = torch.empty(
            (sum(recv_counts), *send.shape[1:]), dtype=send.dtype, device=self.comm_device
        )
        lane = self.lanes[direction] if group is None else group
        t0 = time.perf_counter()  # (not `stats.timed`: a generator per call on the hot path)
        lane.all_to_all_single(recv, send, recv_counts, send_counts)
        self.stats.add_seconds(layer, stage, time.perf_counter() - t0)
        self._account(layer, direction, send_counts, send, peers)
        return recv.to(self.device)

    def _account(
        self,
        layer: int,
        direction: str,
        send_counts: list[int],
        send: torch.Tensor,
        peers: list[int] | range | None = None,
    ) -> None:
        """Counts ``send_counts`` rows of ``send`` to each member (world ranks ``peers``)."""
        self.stats.add(
            layer,
            direction,
            send_counts,
            math.prod(send.shape[1:]) * send.element_size(),
            range(self.topo.world_size) if peers is None else peers,
            self.links,
            self.topo.rank,
        )

    def flush(self) -> None:
        """Waits until every `send_back` has completed (expert ranks, end of a step)."""
        sends, self._sends = self._sends, []
        for t in sends:
            t.wait()


class FlatTransport(Transport):
    """One uneven all-to-all over all ranks per direction; the expert ranks learn their row
    counts with the rows (`all_to_all_counted`: frames that carry their size over shared memory,
    a count exchange first over torch.distributed)."""

    name = "flat"

    def __init__(self, topo: Topology, *args, **kwargs):
        super().__init__(topo, *args, **kwargs)  # same arguments as every transport
        self._attention_ranks = list(range(topo.num_attention))
        # Where the lanes are shared memory, the partial sums go from expert to attention ranks
        # as frames straight on the rings (`send_back`, `combine`), without the general
        # collective's bookkeeping (~25 us a layer and micro-batch on the attention rank, ~10 on
        # the expert rank, paid twice as often with two micro-batches).
        self._frames: ShmLane | None = None
        lanes = (self.lanes["dispatch"], self.lanes["combine"])
        if self.device.type == "cpu" and all(isinstance(lane, ShmLane) for lane in lanes):
            self._frames = lanes[1]  # (expert ranks send their partial sums on it: `send_back`)

    def _dispatch_rows(self, rows: torch.Tensor, counts: list[int], layer: int):
        rows = rows.to(self.comm_device)
        t0 = time.perf_counter()
        out = self.lanes["dispatch"].all_to_all_counted(rows, counts, self._attention_ranks)
        self.stats.add_seconds(layer, "exchange", time.perf_counter() - t0)
        self._account(layer, "dispatch", counts, rows)
        return out

    def dispatch(self, x, topk_ids, topk_weights, layer=UNKNOWN_LAYER):
        self.stats.call(layer, "flat")
        token_index, rows, counts = self.route_rows(x, topk_ids, topk_weights)  # [P, row_bytes]

        def send() -> None:
            self._dispatch_rows(rows, counts, layer)

        sent = self.post("dispatch", send, sends=True, inputs=(rows,))
        return DispatchHandle(
            token_index=token_index,
            send_counts=counts,
            num_tokens=x.shape[0],
            layer=layer,
            sent=sent,
        )

    def combine(self, handle):
        got = self.post("combine", functools.partial(self._partial_sums, handle), sends=False)
        partial = got.wait()  # [P, H]
        handle.sent.wait()  # (done by now: raises what the dispatch raised)
        if partial.shape[0] == handle.num_tokens and max(handle.send_counts) == partial.shape[0]:
            # every token went to one expert rank, the same one (1+1, or all routed to one
            # rank): its rows are each token's sum already, in token order
            return partial
        out = torch.zeros(handle.num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        out.index_add_(0, handle.token_index, partial)
        return out

    def _partial_sums(self, handle: DispatchHandle) -> torch.Tensor:
        """The partial sums of a dispatched layer, ``[P, H]`` in its rows' order."""
        if self._frames is not None:  # each expert rank's frame straight off its ring
            partial = torch.empty(len(handle.token_index), self.hidden_size, dtype=self.dtype)
            self._frame_rows(self._frames.recv_frame, partial, handle.send_counts, handle.layer)
            return partial
        return self.all_to_all(
            self._no_sums, self._zeros, handle.send_counts, handle.layer, "combine"
        )

    def send_back(self, y, batch):
        if self._frames is None:
            return super().send_back(y, batch)
        y = y.contiguous()
        counts = batch.recv_counts

        def send() -> None:
            self._frame_rows(self._frames.send_frame, y, counts, batch.layer)
            self._account(batch.layer, "combine", counts, y)

        self._sends.append(self.post("combine", send, sends=True))

    def _frame_rows(self, move, rows: torch.Tensor, counts: list[int], layer: int) -> None:
        """``move(j, rows, byte offset, byte size)`` for each member j's ``counts[j]`` rows of
        ``rows [N, ...]`` (contiguous, in member order; none for zero counts), timed as the
        layer's exchange."""
        rb, at = math.prod(rows.shape[1:]) * rows.element_size(), 0
        t0 = time.perf_counter()
        for j, n in enumerate(counts):
            if n:
                move(j, rows, at * rb, n * rb)
                at += n
        self.stats.add_seconds(layer, "exchange", time.perf_counter() - t0)

    def receive(self, layer=UNKNOWN_LAYER):
        self.stats.call(layer, "flat")

        def receive() -> tuple[torch.Tensor, list[int], None]:
            rows, recv_counts = self._dispatch_rows(self._no_rows, self._zeros, layer)
            return rows.to(self.device), recv_counts, None

        return ExpertBatch(self.post("dispatch", receive, sends=False), self.unpack, layer)
