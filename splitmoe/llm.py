"""The Python front end: `LLM` starts the attention and expert ranks as processes and feeds them.

```python
from splitmoe import LLM, SamplingParams
with LLM(path, attention_ranks=1, expert_ranks=2, dtype="float32", device="cpu") as llm:
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
```
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing as mp
import os
import pickle
import queue
import random
import select
import signal
import struct
import sys
import time
import traceback
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait

from tqdm import tqdm

from splitmoe.comm.control import RankEvicted
from splitmoe.comm.distributed import hosted_store, shutdown_groups
from splitmoe.comm.topology import Topology
from splitmoe.config import EngineConfig, engine_config
from splitmoe.inputs import broadcast_params, check_request, normalize_prompts
from splitmoe.kernels.cpu_choice import half_octave_bucket
from splitmoe.metrics import ServingMetrics, StepRecord, summarize
from splitmoe.outputs import RequestOutput, StreamDelta, request_error
from splitmoe.runtime import Inbox, rank_openmp_env, run_rank
from splitmoe.sampling_params import SamplingParams
from splitmoe.scheduler.block_manager import block_hashes
from splitmoe.scheduler.request import RequestSpec
from splitmoe.scheduler.router import LeastLoadRouter
from splitmoe.tokenizer import Tokenizer

logger = logging.getLogger("splitmoe")


class RankFailure(RuntimeError):
    """A rank process raised or died; the whole job was stopped."""


def recovery_bound_s(timeout_s: float) -> float:
    """How long a fault-tolerant job's survivors may take to go on without a lost rank: up to
    ``timeout_s`` to notice one that stopped answering, up to another to agree without it
    (`agree_membership`), then rebuild, read weights and replay; past it the front end gives
    up on them."""
    return 3 * timeout_s + 10


_FRAME = struct.Struct("<Q")  # the byte length of each pickled message on a rank's pipe
_EXIT_FLUSH_S = 5.0  # how long an exiting rank tries to hand its last messages over
_QUIET_TICK_S = 0.1  # how often a front end that waits on the bell reads the pipes anyway


class _Outbox:
    """A rank's messages to the front end, over a pipe of its own, pickled and written by the
    rank's main thread without ever blocking it: what the pipe cannot take yet waits in a
    backlog, written at the next `put` or `flush` (so the front end may read late, as with a
    queue). A ``multiprocessing`` queue pickles and writes on a feeder thread instead, which on
    a rank pinned to one core took that core from the step after every emit: the next loop
    iteration started ~170 us later at batch 32 and ~870 us later at batch 256 (1+1 ranks,
    CPU).

    Messages that ``ring`` also write a byte to the ``bell`` pipe that every rank shares, once
    they are in the rank's pipe; so does a full pipe, which the front end must drain. A front
    end that needs only some messages (`LLM.generate` wants finished requests, not each
    step's tokens) waits on the bell alone: a write into a pipe that nobody waits on wakes
    nobody. Waking the front end after every step cost the ranks it shares cores with ~0.2 ms
    a step (1+1 ranks on 2 cores, batch 32, default model: decode 1.12x faster at m=1 and 1.25x
    at m=2 without those wake-ups)."""

    def __init__(self, conn: Connection, bell: Connection | None = None):
        self._conn, self._bell = conn, bell  # (kept: they own the descriptors)
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)
        self._bell_fd = None
        if bell is not None:
            self._bell_fd = bell.fileno()
            os.set_blocking(self._bell_fd, False)
        self._backlog = bytearray()
        self._owe_ring = False  # a ringing message is still in the backlog

    @property
    def pending(self) -> bool:
        return bool(self._backlog)

    def put(self, msg, ring: bool = True) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self._backlog += _FRAME.pack(len(data))
        self._backlog += data
        self._owe_ring |= ring
        self.flush()

    def flush(self) -> None:
        """Writes as much of the backlog as the pipe takes now (none of it once the front end
        has closed its end: nobody will read it, and the rank is about to be stopped); rings
        the bell for a ringing message that reached the pipe, or for a full pipe."""
        while self._backlog:
            try:
                n = os.write(self._fd, self._backlog)
            except BlockingIOError:
                break
            except BrokenPipeError:
                self._backlog.clear()
                self._owe_ring = False
                return
            del self._backlog[:n]
        if self._owe_ring or self._backlog:
            self._ring()
            self._owe_ring = self._owe_ring and bool(self._backlog)

    def _ring(self) -> None:
        if self._bell_fd is None:
            return
        try:
            os.write(self._bell_fd, b"\x01")
        except (BlockingIOError, BrokenPipeError):  # (a full bell rings already)
            pass

    def close(self, wait_s: float = _EXIT_FLUSH_S) -> None:
        """Hands the backlog over, waiting up to ``wait_s`` for the front end to read it (it may
        have stopped reading: at shutdown it only waits for the rank to exit), then closes."""
        deadline = time.monotonic() + wait_s
        try:
            self.flush()
            while self._backlog and time.monotonic() < deadline:
                select.select([], [self._fd], [], max(0.0, deadline - time.monotonic()))
                self.flush()
        except OSError:  # the front end is gone
            pass
        self._conn.close()
        if self._bell is not None:
            self._bell.close()


class _Woken(queue.Empty):
    """`_Inboxes.wake` ended a wait for messages."""


class _Inboxes:
    """The front end's side of the ranks' `_Outbox` pipes and their shared bell: their
    messages, each rank's in order."""

    def __init__(self, conns: list[Connection], bell: Connection | None = None):
        self._live = list(conns)
        self._buffers = {c: bytearray() for c in conns}
        self._ready: deque = deque()
        self._bell = bell
        if bell is not None:
            os.set_blocking(bell.fileno(), False)
        # `wake` (from any thread) ends a `get` that waits: a server's engine loop has requests
        # to submit
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def wake(self) -> None:
        if self._wake_w < 0:  # closed (its number may belong to another file by now)
            return
        try:
            os.write(self._wake_w, b"\x01")
        except (BlockingIOError, OSError):  # (full: it rings already; closed: nobody waits)
            pass

    def _woken(self, readable) -> bool:
        if self._wake_r not in readable:
            return False
        try:
            os.read(self._wake_r, 1 << 16)
        except BlockingIOError:
            pass
        return True

    def get(self, timeout: float, every_message: bool = True):
        """The next message; `queue.Empty` if none came within ``timeout`` s, or when `wake`
        was called. With ``every_message`` False it wakes only when a rank rings the bell (or
        every `_QUIET_TICK_S`), then takes whatever the pipes hold: messages arrive as before,
        in the same order, some later."""
        deadline = time.monotonic() + timeout
        quiet = not every_message and self._bell is not None
        while not self._ready:
            left = deadline - time.monotonic()
            if left < 0:
                raise queue.Empty
            if not self._live:  # every rank has exited
                time.sleep(left)
                raise queue.Empty
            if quiet:
                rung = wait([self._bell, self._wake_r], min(left, _QUIET_TICK_S))
                woken = self._woken(rung)
                if self._bell in rung:
                    self._drain_bell()
                readable = wait(self._live, 0)
            else:
                watched = [*self._live, self._wake_r]
                if self._bell is not None:
                    watched.append(self._bell)
                readable = wait(watched, left)
                woken = self._woken(readable)
            for conn in readable:
                if conn is self._bell:
                    self._drain_bell()
                elif conn != self._wake_r:
                    self._read(conn)
            if woken and not self._ready:
                raise _Woken
        return self._ready.popleft()

    def _drain_bell(self) -> None:
        try:
            os.read(self._bell.fileno(), 1 << 16)
        except BlockingIOError:
            pass

    def _read(self, conn: Connection) -> None:
        data = os.read(conn.fileno(), 1 << 20)
        if not data:  # the rank closed its end (it exited)
            self._live.remove(conn)
            return
        buf = self._buffers[conn]
        buf += data
        at = 0
        while len(buf) - at >= _FRAME.size:
            (n,) = _FRAME.unpack_from(buf, at)
            if len(buf) - at - _FRAME.size < n:
                break
            start = at + _FRAME.size
            self._ready.append(pickle.loads(buf[start : start + n]))
            at = start + n
        del buf[:at]

    def close(self) -> None:
        for conn in self._buffers:
            conn.close()
        if self._bell is not None:
            self._bell.close()
        wake_w, self._wake_w = self._wake_w, -1
        os.close(wake_w)
        os.close(self._wake_r)
        self._live = []


class _QueueChannel:
    """Channel of an `LLM`-spawned rank: commands in through a queue, results out through a pipe
    of its own (`_Outbox`).

    In: ``("add", [RequestSpec])``, ``("abort", [request id])`` (attention ranks),
    ``("stats",)``, ``("close",)``.
    """

    def __init__(self, rank: int, in_q, out: _Outbox, takes_requests: bool):
        self.rank = rank
        self.in_q = in_q
        self.out = out
        self._closed = not takes_requests

    @property
    def closed(self) -> bool:
        return self._closed

    def poll(self, timeout: float) -> Inbox:
        inbox = Inbox()
        if self.out.pending:  # (the front end reads late: keep handing the backlog over)
            self.out.flush()
            timeout = min(timeout, 0.005) if self.out.pending else timeout
        try:
            msg = self.in_q.get(timeout=timeout) if timeout > 0 else self.in_q.get_nowait()
            while True:
                self._take(inbox, msg)
                msg = self.in_q.get_nowait()
        except queue.Empty:
            pass
        return inbox

    def _take(self, inbox: Inbox, msg: tuple) -> None:
        """One command from the front end into ``inbox``."""
        if msg[0] == "add":
            inbox.requests.extend(msg[1])
        elif msg[0] == "abort":
            inbox.aborts.extend(msg[1])
        elif msg[0] == "stats":
            inbox.stats_wanted = True
        elif msg[0] == "trace":
            inbox.trace_wanted = True
        elif msg[0] == "rebalance":
            inbox.rebalance_wanted = True
        elif msg[0] == "wake":  # work arrived elsewhere: join the next sync now
            pass
        else:
            self._closed = True

    def emit(self, updates, record) -> None:
        msg, finished = _step_message(self.rank, updates, record)
        # (rings only when a request finished: what every waiting front end wants)
        self.out.put(msg, ring=finished)

    def send_stats(self, stats: dict) -> None:
        self.out.put(("stats", self.rank, stats))

    def publish(self, counters: dict) -> None:
        # (quiet: a waiting front end reads them at its next tick, see `_Inboxes.get`)
        self.out.put(("snapshot", self.rank, counters), ring=False)

    def ready(self, topo: Topology) -> None:
        self.out.put(("ready", self.rank, topo.role))

    def recovered(self, membership: dict) -> None:
        """The job lost ranks and goes on (fault tolerance): its new membership."""
        self.out.put(("recovered", self.rank, membership))


def _step_message(rank: int, updates, record) -> tuple[tuple, bool]:
    """A step's updates as the front end's ``"step"`` message, and whether a request finished.

    As plain lists (`LLM._apply_step` reads them): 128 dataclass objects took ~350 us to pickle
    and as long to unpickle in the front end, against ~45 us for these lists. (A finished
    request's update, and only that, carries its metrics, and its error if it failed.)"""
    ids = [u.request_id for u in updates]
    tokens = [u.new_token_ids for u in updates]
    finished = [
        (i, u.finish_reason, u.metrics, u.error) for i, u in enumerate(updates) if u.metrics
    ]
    logprobs = None
    if any(u.logprobs for u in updates):
        logprobs = [u.logprobs for u in updates]
    return ("step", rank, (ids, tokens, finished, logprobs), record), bool(finished)


class RelayChannel(_QueueChannel):
    """Rank 0's channel in a launched server (torchrun, mpirun): besides its own commands its
    queue carries ``("relay", rank, command)`` for the ranks in other processes, which go out
    with the next step sync (`StepSync.relay`); their answers (step progress, stats) come back
    the same way and go to the front end as if the rank had sent them itself."""

    def __init__(self, rank: int, in_q, out: _Outbox, takes_requests: bool):
        super().__init__(rank, in_q, out, takes_requests)
        self._mail: dict[int, list] = {}

    def _take(self, inbox: Inbox, msg: tuple) -> None:
        if msg[0] == "relay":
            self._mail.setdefault(msg[1], []).append(msg[2])
        else:
            super()._take(inbox, msg)

    def outgoing(self):
        mail, self._mail = self._mail, {}
        return mail or None

    def deliver(self, mail: list) -> None:
        for blob in mail[1:]:
            for msg in pickle.loads(blob) if blob else ():
                ring = bool(msg[2][2]) if msg[0] == "step" else msg[0] != "snapshot"
                self.out.put(msg, ring=ring)


class RemoteChannel:
    """The channel of a launched server's rank in another process than the server (rank > 0):
    its commands arrive from rank 0's `RelayChannel` with the step sync, and its step progress
    and stats leave with the next one. It never blocks in `poll`: an idle rank waits in the step
    sync, which rank 0 joins as soon as its front end has work."""

    def __init__(self, rank: int, takes_requests: bool):
        self.rank = rank
        self._closed = not takes_requests
        self._commands: list = []
        self._out: list = []

    @property
    def closed(self) -> bool:
        return self._closed

    def poll(self, timeout: float) -> Inbox:
        inbox = Inbox()
        commands, self._commands = self._commands, []
        for msg in commands:
            _QueueChannel._take(self, inbox, msg)
        return inbox

    def emit(self, updates, record) -> None:
        self._out.append(_step_message(self.rank, updates, record)[0])

    def send_stats(self, stats: dict) -> None:
        self._out.append(("stats", self.rank, stats))

    def publish(self, counters: dict) -> None:
        self._out.append(("snapshot", self.rank, counters))

    def ready(self, topo: Topology) -> None:
        pass  # (rank 0 is ready only once every rank joined its start-up collectives)

    def outgoing(self):
        out, self._out = self._out, []
        return out or None

    def deliver(self, mail: list) -> None:
        if mail[0]:  # (only rank 0 sends commands; the other ranks' mail is rank 0's)
            self._commands += pickle.loads(mail[0]).get(self.rank, [])


class _Relayed:
    """What the front end holds for a rank in another process: its commands go through rank
    0's queue (see `RelayChannel`)."""

    def __init__(self, rank0_q, rank: int):
        self.q, self.rank = rank0_q, rank

    def put(self, msg: tuple) -> None:
        self.q.put(("relay", self.rank, msg))


def _die_with_parent() -> None:
    try:  # Linux: the kernel kills this rank if the front end dies (even by SIGKILL).
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


_MAIN_GUARD = 'if __name__ == "__main__":'


def _check_not_bootstrapping() -> None:
    """Refuses to build an `LLM` in a process that multiprocessing is still starting.

    `LLM` starts its ranks with the "spawn" method, whose new process first runs the parent's
    main script again (as module ``__mp_main__``): a script that builds its LLM at its top
    level, outside the main guard, builds one in every rank, which multiprocessing then stops
    with a message naming neither splitmoe nor the fix. ``_inheriting`` is the flag that
    multiprocessing's own check reads (``multiprocessing.spawn._check_not_importing_main``)."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError(
            "LLM(...) was called while multiprocessing was starting this process with the "
            "'spawn' method, the way LLM starts its rank processes: a new process first runs "
            "the main script again, and this script creates an LLM at its top level. Put the "
            f"code that creates and uses the LLM under `{_MAIN_GUARD}`:\n\n"
            "    from splitmoe import LLM\n\n"
            f"    {_MAIN_GUARD}\n"
            "        llm = LLM(...)\n"
            "        outputs = llm.generate(...)\n"
        )


def _spawn_failure_hint(procs: list[mp.Process]) -> str:
    """The start-up failure's hint when ranks exited with an error code without reporting it:
    `_rank_main` reports every failure, so they failed before it ran, while multiprocessing was
    starting them, which runs the main script again (see `_check_not_bootstrapping`)."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if script is None or not any(p.exitcode is not None and p.exitcode > 0 for p in procs):
        return ""
    return (
        f", before reporting in. A rank process first runs the main script {script} again "
        "(multiprocessing's 'spawn' start method); a failure there ends it (see the rank's "
        "traceback on stderr). If the script creates the LLM at its top level, put that code "
        f"under `{_MAIN_GUARD}`."
    )


@dataclass(frozen=True)
class LaunchedJob:
    """A job whose ranks a launcher (torchrun, mpirun) started, this process being rank 0's: an
    `LLM` built with it spawns only attention rank 0 (as a child that joins the launcher's
    rendezvous), and the other ranks run `splitmoe.runtime.run_rank` in their own processes."""

    init_method: str
    local_rank: int
    local_world_size: int


def _rank_main(
    cfg: EngineConfig,
    rank: int,
    init_method: str,
    in_q,
    out_conn,
    bell,
    local_rank: int | None = None,
    local_world_size: int | None = None,
) -> None:
    _die_with_parent()
    # Ctrl-C reaches the whole terminal process group: the front end handles it and stops the
    # ranks, so a rank ignores it instead of dying mid-collective with a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    role = "attention" if rank < cfg.parallel.attention_ranks else "expert"
    out = _Outbox(out_conn, bell)
    # (launched: rank 0 relays for the ranks in the launcher's other processes)
    kind = RelayChannel if local_rank is not None else _QueueChannel
    channel = kind(rank, in_q, out, takes_requests=role == "attention")
    try:
        run_rank(cfg, rank, init_method, channel, local_rank, local_world_size)
        shutdown_groups()
    except RankEvicted as e:  # (the others went on without this rank: not the job's failure)
        out.put(("evicted", rank, role, str(e)))
        out.close()
        sys.exit(1)
    except BaseException as e:  # report every failure, Ctrl-C included, then exit non-zero
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        out.put(("error", rank, role, detail, traceback.format_exc()))
        out.close()
        sys.exit(1)
    out.put(("exit", rank, role))
    out.close()


class _Detokenizer:
    """Text deltas of one request's output, decoding only the tokens since the last delta plus
    the ones before them that give them context (the prefix and read offsets of vLLM's
    incremental detokenizer), not the whole output at every token. A delta waits while the text
    ends in an incomplete character. At the end, what the full decode adds is the last delta, so
    the deltas add up to the output's text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix = self.read = 0  # token offsets: context start, end of what was emitted
        self.text = ""  # emitted so far

    def delta(self, out: RequestOutput) -> str:
        if out.finished:
            rest = out.text[len(self.text) :] if out.text.startswith(self.text) else ""
            self.text += rest
            return rest
        ids = out.token_ids
        before = self.tokenizer.decode(ids[self.prefix : self.read])
        after = self.tokenizer.decode(ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(ids)
        new = after[len(before) :]
        self.text += new
        return new


class _StopWatch:
    """Finds a request's stop strings in its decoded output as its tokens arrive.

    As vLLM's detokenizer: text that arrives while at most ``min_tokens`` tokens were generated
    is not searched (a stop string may still begin in it and end later)."""

    def __init__(self, tokenizer, strings: tuple[str, ...], min_tokens: int = 0):
        self.detok = _Detokenizer(tokenizer)
        self.strings = strings
        self.min_tokens = min_tokens
        self.hit: tuple[int, str] | None = None  # (tokens kept, text kept) once one appeared

    def check(self, out: RequestOutput) -> bool:
        """Whether a stop string has appeared (now or before); the first occurrence wins."""
        if self.hit is None:
            new = self.detok.delta(out)
            if new and len(out.token_ids) > self.min_tokens:
                text = self.detok.text
                end = len(text) - len(new)  # (each string is looked for where it could end)
                found = [
                    i
                    for i in (text.find(x, max(0, end - len(x) + 1)) for x in self.strings)
                    if i >= 0
                ]
                if found:
                    self.hit = (len(out.token_ids), text[: min(found)])
        return self.hit is not None


def _front_end_fault(request_id: int, stage: str, error: Exception) -> str:
    """Logs a fault that fails one request alone (with its traceback); returns its error."""
    logger.error("request %d failed in %s and is ended", request_id, stage, exc_info=error)
    return request_error(stage, error)


class LLM:
    """Starts ``attention_ranks + expert_ranks`` rank processes and serves `generate` calls.

    Options are those of the config dataclasses (`splitmoe.config.engine_options`: the same
    as the launcher's flags); an unknown one is a TypeError.

    Args:
        model: HF-format checkpoint directory (config.json + *.safetensors [+ tokenizer.json]).
        attention_ranks: data-parallel attention ranks (each with its own KV cache and scheduler).
        expert_ranks: ranks holding the routed experts; 0 runs them inside the attention rank.
        transport: attention<->expert communication scheme (``"flat"``).
        ranks_per_node: ranks that share a fast link; set it to emulate several nodes.
        micro_batches: split each step into this many micro-batches so that attention and the
            experts overlap (ping-pong); None chooses per step (2 with expert ranks and enough
            tokens, else 1).
        dtype: ``"auto"`` (on CPU bfloat16 where it has AMX / AVX512-BF16, else float32; the
            checkpoint's dtype on CUDA), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        block_size, num_kv_blocks, kv_cache_memory_gb: paged KV cache (see `CacheConfig`).
        max_num_seqs, max_num_batched_tokens, max_model_len: scheduler limits per attention rank.
        threads_per_rank: torch's CPU threads per rank (default: the host's cores shared by its
            ranks). See `runtime.set_threads`.
        timeout_s: how long a collective, a step or start-up may take before the job is failed
            (a hung rank is detected within this bound; a dead one at once).
        attention_backend, moe_backend: ``"auto"`` (Triton on CUDA, PyTorch on CPU),
            ``"torch"`` or ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``).
        seed: seeds the random streams of sampled requests that carry no seed of their own, so
            a `generate` call is reproducible.
        redundant_experts: extra expert slots per MoE layer on the expert ranks, holding
            replicas of hot experts (ignored when colocated).
        balancer: per-step replica choice, ``"static"`` (a fixed replica per attention rank and
            expert), ``"local"`` (each attention rank spreads its own tokens) or ``"global"``
            (attention ranks share per-expert counts and minimise the busiest expert rank's
            cost); see `splitmoe.eplb.policy`.
        rebalance_interval: recompute the placement from observed load every this many steps
            (None: only on `rebalance`).
        shared_memory: ranks exchange tokens through shared memory (the ranks of `LLM` share
            this host) instead of gloo over loopback TCP; False forces torch.distributed.
    """

    def __init__(self, model: str, *, launched: LaunchedJob | None = None, **options):
        _check_not_bootstrapping()
        self._launched = launched
        self._procs: list[mp.Process] = []
        self.config = engine_config(model, **options)
        # Reads and checks every tensor header before any rank starts.
        from splitmoe.models.loader import CheckpointReader

        CheckpointReader(model)
        # Each rank's bytes against the device memory, before any rank starts: a layout that
        # does not fit fails here with the per-rank table (`splitmoe.memory`).
        from splitmoe.memory import check_fits

        check_fits(self.config, local_ranks=1 if launched is not None else None)
        self.tokenizer = Tokenizer.from_checkpoint(model)
        self._next_id = 0
        self._live: dict[int, RequestOutput] = {}
        # what each live request was submitted as: fault tolerance resumes a lost attention
        # rank's requests from it (`_resume_lost`); and the ids whose abort was asked
        self._specs: dict[int, RequestSpec] = {}
        self._aborted: set[int] = set()
        self._stops: dict[int, _StopWatch] = {}  # live requests with stop strings
        # live requests that failed in this front end, each aborted on its rank (id -> error)
        self._faults: dict[int, str] = {}
        self._last_step: dict[int, StepRecord] = {}  # each attention rank's latest step
        self._stats: dict[int, dict] = {}
        # each rank's latest published counters, replaced whole (`latest_stats` reads it from
        # any thread)
        self._snapshots: tuple[dict, ...] = ()
        # progress read while `stats` / `rebalance` waited for their answers: the next `poll`
        # returns it (a server asks for stats while requests run)
        self._backlog: list[tuple[RequestOutput, list[int]]] = []
        # fault tolerance: ranks seen gone (start-up rank -> time.monotonic() when seen), and
        # the recoveries the ranks reported (`recoveries`)
        self._lost: dict[int, float] = {}
        self._recoveries: list[dict] = []
        self._moved: set[int] = set()  # lost attention ranks whose requests were resumed
        self.reset_metrics()
        self._start()

    # ---- process management -------------------------------------------------------------------
    def _start(self) -> None:
        cfg = self.config
        ctx = mp.get_context("spawn")
        A, W = cfg.parallel.attention_ranks, cfg.parallel.world_size
        job = self._launched
        local = 1 if job is not None else W  # (the ranks this process starts)
        self._in_qs = [ctx.Queue() for _ in range(local)]
        # every rank's command queue, in rank order: launched, rank 0 relays for the others
        self._to_rank = [*self._in_qs, *(_Relayed(self._in_qs[0], r) for r in range(local, W))]
        if job is not None:
            init_method = job.init_method
        else:
            # the rendezvous store is bound here, on a port the OS picks, before any rank
            # starts: a port picked free and bound later by rank 0 can be taken meanwhile
            # (EADDRINUSE with several servers starting at once); with fault tolerance it
            # must also outlive any rank
            self._store, init_method = hosted_store("127.0.0.1", cfg.parallel.timeout)
        where = (job.local_rank, job.local_world_size) if job else (None, None)
        readers = []
        bell_reader, bell = ctx.Pipe(duplex=False)  # (shared by the ranks: see `_Outbox`)
        # (a spawned process takes this process's environment as it is when it starts; the
        # variables are set only where the user has not set them)
        omp = rank_openmp_env(cfg, job.local_world_size if job else W)
        os.environ.update(omp)
        try:
            self._spawn(ctx, cfg, local, init_method, bell, where, readers)
        finally:
            for k in omp:
                os.environ.pop(k, None)
        bell.close()
        self._out = _Inboxes(readers, bell_reader)
        self._finalizer = weakref.finalize(self, _kill_all, list(self._procs), self._in_qs)
        atexit.register(self._finalizer)
        cache = cfg.cache
        blocks = cache.resolve_num_blocks(
            cfg.model, cfg.torch_dtype, cfg.scheduler.max_num_seqs, cfg.max_model_len
        )
        self._router = LeastLoadRouter(A, blocks if cache.enable_prefix_caching and A > 1 else 0)
        ready = 0
        deadline = time.monotonic() + cfg.parallel.timeout_s + 60
        while ready < local:
            msg = self._next_message(deadline, "start-up")
            if msg[0] == "ready":
                ready += 1

    def _spawn(self, ctx, cfg, local: int, init_method: str, bell, where, readers) -> None:
        """Starts this process's ranks, each with a pipe for its messages (into ``readers``)."""
        for rank in range(local):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main,
                args=(cfg, rank, init_method, self._in_qs[rank], writer, bell, *where),
                name=f"splitmoe-rank{rank}",
                daemon=True,
            )
            p.start()
            writer.close()  # (the rank has its own copy: its exit closes the pipe)
            readers.append(reader)
            self._procs.append(p)

    def _role(self, rank: int) -> str:
        return "attention" if rank < self.config.parallel.attention_ranks else "expert"

    def _next_message(
        self, deadline: float, what: str, fail_on_timeout: bool = True, every_step: bool = True
    ):
        """Next message from the ranks; a failed or dead rank stops the whole job. Past the
        deadline: `RankFailure` (``fail_on_timeout``) or `queue.Empty`. ``every_step`` False:
        the caller needs no step promptly unless a request finished in it (see `_Outbox`)."""
        while True:
            try:
                left = max(0.0, min(0.1, deadline - time.monotonic()))
                msg = self._out.get(left, every_message=every_step)
            except _Woken:
                raise
            except queue.Empty:
                died = self._dead_ranks(exclude=-1, grace_s=0)
                lost = self._survive_losses(what)  # (then the job goes on without them)
                if not lost and (died or any(p.exitcode is not None for p in self._procs)):
                    hint = _spawn_failure_hint(self._procs) if what == "start-up" else ""
                    self._fail(f"{died or 'a rank exited early'} during {what}{hint}")
                if lost and self.health == "degraded":
                    # the survivors may first notice at their timeout, then agree within
                    # another; past that they report their own failure
                    bound = recovery_bound_s(self.config.parallel.timeout_s)
                    deadline = max(deadline, min(self._lost.values()) + bound)
                if time.monotonic() >= deadline:
                    if not fail_on_timeout:
                        raise
                    self._fail(f"no progress from the ranks for too long during {what}")
                continue
            if msg[0] == "snapshot":  # (kept, never handed to a caller)
                self._keep_snapshot(msg[1], msg[2])
                continue
            if msg[0] == "recovered":  # (kept, never handed to a caller)
                self._note_recovery(msg[2])
                continue
            if msg[0] == "evicted":  # (a rank that woke after its peers went on without it)
                logger.warning("rank %d (%s): %s", msg[1], msg[2], msg[3])
                self._lost.setdefault(msg[1], time.monotonic())
                self._end_rank(msg[1])
                continue
            if msg[0] == "error" and msg[1] in self._evicted():
                logger.warning("rank %d (%s), left out of the job, failed: %s", *msg[1:4])
                continue
            if msg[0] == "error":
                _, rank, role, detail, tb = msg
                died = self._dead_ranks(exclude=rank)
                cause = f"{died}; then " if died else ""
                self._fail(
                    f"{cause}rank {rank} ({role}) failed: {detail}\n"
                    f"--- rank {rank} traceback ---\n{tb}"
                )
            return msg

    def _survive_losses(self, what: str) -> bool:
        """With fault tolerance, notes ranks that exited (their peers recover without them:
        the job is `health` "degraded" until they report it); True if the job can go on: at
        least one attention and one expert rank (if it had any) still run. (Launched jobs:
        the launcher stops every rank when one exits; rank 0's loss is not survived there.)"""
        if not self.config.parallel.fault_tolerance or what == "start-up":
            return False
        exited = [r for r, p in enumerate(self._procs) if p.exitcode is not None]
        if not exited or (self._launched is not None and 0 in exited):
            return False
        par = self.config.parallel
        live = [r for r in range(par.world_size) if r not in exited]
        roles = {self._role(r) for r in live}
        if "attention" not in roles or (par.expert_ranks and "expert" not in roles):
            return False
        now = time.monotonic()
        for r in exited:
            if r not in self._lost:
                logger.warning("rank %d (%s) exited; the job recovers without it", r, self._role(r))
                self._lost[r] = now
        return True

    def _note_recovery(self, membership: dict) -> None:
        for rec in membership["recoveries"][len(self._recoveries) :]:
            seen = [self._lost[r] for r in rec["lost"] if r in self._lost]
            rec = dict(rec, noticed_s_ago=time.monotonic() - min(seen) if seen else None)
            self._recoveries.append(rec)
            for r in rec["lost"]:  # (one left out while still running: silent past timeout_s)
                self._lost.setdefault(r, time.monotonic())
                self._end_rank(r)
                if self._role(r) == "attention":
                    self._resume_lost(r)
            # (a lost rank's last counters would show its blocks held for ever)
            self._snapshots = tuple(s for s in self._snapshots if s["rank"] not in self._lost)

    def _evicted(self) -> set[int]:
        """Ranks (as at start-up) that a recovery left out."""
        return {r for rec in self._recoveries for r in rec["lost"]}

    def _end_rank(self, rank: int) -> None:
        """Ends a rank its peers left out (fault tolerance), if this process started it and it
        still runs: stopped (SIGSTOP: a stopped process takes SIGKILL too), hung, or woken
        after the others went on; it would hold its memory and cores for nothing. Reaped here,
        so nothing is left of it. (A launched job's other ranks are their launcher's; one that
        wakes finds itself left out and exits: `RankEvicted`.)"""
        if rank >= len(self._procs):
            return
        p = self._procs[rank]
        if p.exitcode is None:
            role = self._role(rank)
            logger.warning("rank %d (%s), left out of the job by its peers, is ended", rank, role)
            p.kill()
        p.join(timeout=5)

    def _resume_lost(self, rank: int) -> None:
        """Moves a lost attention rank's unfinished requests to the surviving ones (the job
        has rebuilt itself without it): each resumes from its prompt plus the tokens this
        front end has received, as a preempted request does, so a stream goes on with no
        token repeated or missing; whatever the lost rank said afterwards is ignored. Greedy
        outputs equal the unfaulted run's; a seeded sampled one continues with a fresh stream.
        A request whose abort or stop was asked is resumed and aborted at once (the abort
        answers it)."""
        self._moved.add(rank)
        self._router.retire(rank)
        moved: dict[int, list[RequestSpec]] = {}
        again: dict[int, list[int]] = {}
        for rid, out in self._live.items():
            if out.attention_rank != rank:
                continue
            spec = self._specs[rid]
            tokens = out.token_ids
            new = self._route(spec, len(spec.prompt_token_ids) + len(tokens))
            params = spec.params
            if params.kv_transfer_params is not None:  # (computed here: the pull is over)
                params = replace(params, kv_transfer_params=None)
            resumed = replace(spec, params=params, output_token_ids=list(tokens))
            moved.setdefault(new, []).append(resumed)
            out.attention_rank = new
            watch = self._stops.get(rid)
            if rid in self._aborted or rid in self._faults or (watch and watch.hit):
                again.setdefault(new, []).append(rid)
        for new, specs in moved.items():
            logger.warning(
                "%d request(s) of lost attention rank %d resume on rank %d", len(specs), rank, new
            )
            self._to_rank[new].put(("add", specs))
            if new in again:
                self._to_rank[new].put(("abort", again[new]))

    @property
    def health(self) -> str:
        """``"ok"``, or ``"degraded"`` while the job recovers from a lost rank (fault
        tolerance): from when this front end saw the rank exit until its peers report that
        they go on without it."""
        return "degraded" if set(self._lost) - self._evicted() else "ok"

    @property
    def recoveries(self) -> list[dict]:
        """Each recovery from lost ranks (fault tolerance), as the ranks reported it:
        ``lost`` and ``members`` (ranks as at start-up), ``seconds`` (from the failure to the
        rebuilt job, on the reporting rank), ``weights_read`` (that rank's (layer, slot)
        weights read again from the checkpoint), ``placement_version``."""
        return list(self._recoveries)

    def _dead_ranks(self, exclude: int, grace_s: float = 0.5) -> str:
        """Ranks that died without reporting (killed, out of memory): usually the root cause when
        a peer reports a broken connection."""
        deadline = time.monotonic() + grace_s
        ended = self._evicted()  # (by this front end, after the others went on without them)
        while True:
            dead = [
                (r, p.exitcode)
                for r, p in enumerate(self._procs)
                if r != exclude and r not in ended and p.exitcode is not None and p.exitcode != 0
            ]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        told = "; ".join(
            f"rank {r} ({self._role(r)}) died "
            + (f"(killed by {signal.Signals(-c).name})" if c < 0 else f"(exit code {c})")
            for r, c in dead
        )
        if self._launched is not None and any(c == -signal.SIGTERM for _, c in dead):
            told += (
                " (a launcher stops every rank when one fails: its report names the rank that "
                "failed first)"
            )
        return told

    def _fail(self, message: str):
        self._shutdown(graceful=False)
        raise RankFailure(message) from None  # (not chained to a queue.Empty being handled)

    def _shutdown(self, graceful: bool) -> None:
        if not self._procs:
            return
        if graceful:
            for q in reversed(self._to_rank):  # (rank 0 last: it relays the others' closes)
                q.put(("close",))
            deadline = time.monotonic() + 30
            for p in self._procs:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
        _kill_all(self._procs, self._in_qs)
        self._procs = []
        self._out.close()
        self._store = None  # (the rendezvous store's socket and thread go with it)
        self._finalizer.detach()

    def close(self) -> None:
        """Stops every rank; safe to call twice."""
        self._shutdown(graceful=True)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._shutdown(graceful=exc_type is None)

    # ---- generation ---------------------------------------------------------------------------
    def submit(self, prompts, sampling_params=None) -> list[int]:
        """Validates and sends requests to the attention ranks without waiting; returns their
        request ids. Results come from `poll` (or use `generate` / `stream`)."""
        if not self._procs:
            raise RuntimeError("this LLM is closed; create a new one")
        ids = normalize_prompts(prompts, self.tokenizer)
        params = broadcast_params(sampling_params, len(ids))
        for i, (p, sp) in enumerate(zip(ids, params)):
            check_request(i, p, sp, self.config)
        for sp in params:
            if sp.stop and self.tokenizer is None:
                raise ValueError(
                    "stop strings need the checkpoint's tokenizer.json (they are matched on the "
                    "decoded text); use stop_token_ids"
                )
        now = time.time()
        batches: list[list[RequestSpec]] = [[] for _ in range(self.config.parallel.attention_ranks)]
        rids = []
        for p, sp in zip(ids, params):
            rid = self._next_id
            self._next_id += 1
            spec = RequestSpec(rid, list(p), sp, now)
            rank = self._route(spec, len(p))
            batches[rank].append(spec)
            self._specs[rid] = spec
            self._live[rid] = RequestOutput(
                request_id=rid,
                prompt_token_ids=spec.prompt_token_ids,
                attention_rank=rank,
                logprobs=None if sp.logprobs is None else [],
            )
            if sp.stop:
                self._stops[rid] = _StopWatch(self.tokenizer, sp.stop, sp.min_tokens)
            rids.append(rid)
        for rank, batch in enumerate(batches):  # (the attention ranks' queues)
            if rank not in self._lost:  # idle ranks join the next step now
                self._to_rank[rank].put(("add", batch) if batch else ("wake",))
        return rids

    def _route(self, spec: RequestSpec, cost: int) -> int:
        """The attention rank for ``spec`` (`LeastLoadRouter`: least load, then the likeliest
        cached prefix when prefix caching routes), charged ``cost`` tokens."""
        hashes = ()
        if self._router.capacity:
            bs = self.config.cache.block_size
            hashes = block_hashes(spec.prompt_token_ids, bs, salt=spec.params.cache_salt)
        return self._router.pick(cost, hashes)

    def abort(self, request_ids: list[int]) -> None:
        """Stops these requests on their attention ranks, which free their KV blocks at once;
        each comes back from `poll` finished with ``finish_reason="abort"`` (ids that already
        finished are ignored)."""
        by_rank: dict[int, list[int]] = {}
        for rid in request_ids:
            out = self._live.get(rid)
            if out is not None:
                by_rank.setdefault(out.attention_rank, []).append(rid)
                self._aborted.add(rid)
        for rank, rids in by_rank.items():
            self._to_rank[rank].put(("abort", rids))

    def wake(self) -> None:
        """Makes a `poll` that waits in another thread return now (thread-safe): a server's
        engine loop has new requests to submit."""
        self._out.wake()

    def poll(
        self, timeout: float | None = None, every_step: bool = True
    ) -> list[tuple[RequestOutput, list[int]]]:
        """Waits for the next step's progress (up to ``timeout`` s, or the job's collective
        timeout (with fault tolerance, the bound of a recovery: `recovery_bound_s`), or until
        `wake`); returns ``(output so far, new token ids)`` per request that
        advanced. With ``every_step`` False only finished requests are returned (with no new
        tokens listed), and the ranks wake this process only for steps in which one finished,
        which spares the cores it shares with them. A failed rank raises `RankFailure` here."""
        if self._backlog:
            progress, self._backlog = self._backlog, []
            return progress if every_step else [(o, []) for o, _ in progress if o.finished]
        if not every_step:
            finished: list[RequestOutput] = []
            self._pump(timeout, None, finished)
            return [(out, []) for out in finished]
        progress = []
        self._pump(timeout, progress, [])
        return progress

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not finished yet."""
        return len(self._live)

    @property
    def last_steps(self) -> dict[int, StepRecord]:
        """Each attention rank's most recent `StepRecord` (running and waiting requests, KV
        blocks in use)."""
        return dict(self._last_step)

    def _pump(self, timeout: float | None, progress: list | None, finished: list) -> None:
        """Reads the ranks' messages until one step's tokens (or a stats answer) arrived, up to
        ``timeout`` s (None: `_silence_s`, then `RankFailure`); appends
        ``(output, new tokens)`` per advanced request to ``progress`` (None: not wanted, and the
        ranks wake this process only for steps in which a request finished) and the outputs
        that finished to ``finished``.

        This runs once per step of every attention rank, on the same cores as the ranks where
        they share a host: at decode batch 256 it took ~1.5 ms of CPU per step when it built an
        update object and a stream delta per token (CPU, 1+1 ranks on 2 cores)."""
        wait = self._silence_s() if timeout is None else timeout
        deadline = time.monotonic() + wait
        while True:
            try:
                msg = self._next_message(
                    deadline, "generate", timeout is None, every_step=progress is not None
                )
            except queue.Empty:
                return
            if msg[0] == "stats":
                self._stats[msg[1]] = msg[2]
                return
            if msg[0] == "step":
                _, rank, (ids, tokens, done, logprobs), record = msg
                if rank in self._moved:  # (late words of a lost rank: its requests moved)
                    continue
                self._apply_step(rank, ids, tokens, done, logprobs, record, progress, finished)
                return

    def _silence_s(self) -> float:
        """How long `poll` waits for a step before it fails the job: the collective timeout;
        with fault tolerance, the bound of a recovery (`recovery_bound_s`), since a rank that
        stops answering silences every step until its peers have noticed and gone on."""
        par = self.config.parallel
        return recovery_bound_s(par.timeout_s) if par.fault_tolerance else par.timeout_s

    def _apply_step(self, rank, ids, tokens, done, logprobs, record, progress, finished) -> None:
        """One step's new tokens (`_QueueChannel.emit`'s lists) into the live outputs.

        An exception in one request's stop-string check or detokenizing fails that request
        alone: it is aborted on its rank (which frees its blocks) and finishes with
        ``finish_reason="error"`` once the rank confirms, reporting nothing more until then."""
        if record is not None:  # (None: aborted requests, outside a step)
            self._steps.append(record)
            self._last_step[rank] = record
        live, stops, faults = self._live, self._stops, self._faults
        if stops or logprobs is not None or faults:
            for j, (rid, new) in enumerate(zip(ids, tokens)):
                out = live[rid]
                out.token_ids.extend(new)
                if logprobs is not None and logprobs[j]:
                    out.logprobs.extend(logprobs[j])
                if rid in faults:
                    continue
                watch = stops.get(rid)
                if watch is not None:
                    try:
                        hit = watch.check(out)
                    except Exception as e:
                        self._request_fault(rank, rid, "stop-string check", e)
                        continue
                    if hit:
                        if watch.hit[0] == len(out.token_ids) and new:  # (it just appeared)
                            self._to_rank[out.attention_rank].put(("abort", [rid]))
                        continue  # (nothing past a stop string is reported)
                if progress is not None:
                    progress.append((out, new))
        elif progress is None:
            for rid, new in zip(ids, tokens):
                live[rid].token_ids.extend(new)
        else:
            for rid, new in zip(ids, tokens):
                out = live[rid]
                out.token_ids.extend(new)
                progress.append((out, new))
        self._router.add(rank, sum(map(len, tokens)))
        for i, reason, metrics, error in done:
            rid = ids[i]
            out = live.pop(rid)
            self._specs.pop(rid, None)
            self._aborted.discard(rid)
            self._router.release(rank, len(out.prompt_token_ids) + len(out.token_ids))
            watch = stops.pop(rid, None)
            fault = faults.pop(rid, None)
            if fault is not None:  # (whatever the rank says: it failed here first)
                reason, error = "error", fault
                if progress is not None:
                    progress.append((out, []))
            elif watch is not None and watch.hit is not None:
                n, out.text = watch.hit
                del out.token_ids[n:]
                if out.logprobs is not None:
                    del out.logprobs[n:]
                reason, metrics = "stop", replace(metrics, num_output_tokens=n)
                if progress is not None:
                    progress.append((out, []))
            elif self.tokenizer is not None:
                try:
                    out.text = self.tokenizer.decode(out.token_ids)
                except Exception as e:
                    reason, error = "error", _front_end_fault(rid, "detokenizing", e)
            out.finish_reason, out.metrics, out.error = reason, metrics, error
            # (a request its client gave up on, or that failed, says nothing of speed)
            if reason != "abort" and reason != "error":
                self._finished.append(out)
            finished.append(out)

    def _request_fault(self, rank: int, rid: int, stage: str, error: Exception) -> None:
        """Fails one live request after ``stage`` raised for it here: logged, aborted on its
        rank, finished with ``"error"`` when the rank's abort comes back."""
        self._faults[rid] = _front_end_fault(rid, stage, error)
        self._stops.pop(rid, None)
        self._to_rank[self._live[rid].attention_rank].put(("abort", [rid]))

    def stream(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> Iterator[StreamDelta]:
        """Generates like `generate`, yielding a `StreamDelta` as each token is produced."""
        return self._follow(self.submit(prompts, sampling_params))

    def _follow(self, rids: list[int]) -> Iterator[StreamDelta]:
        """Deltas of ``rids`` as their tokens arrive."""
        index = {rid: i for i, rid in enumerate(rids)}
        detok = {rid: _Detokenizer(self.tokenizer) for rid in rids}
        pending = set(rids)
        try:
            while pending:
                for out, new in self.poll():
                    if out.request_id not in index:
                        continue  # another caller's request
                    text = ""
                    if self.tokenizer is not None:
                        text = detok[out.request_id].delta(out)
                    if out.finished:
                        pending.discard(out.request_id)
                    yield StreamDelta(
                        index=index[out.request_id],
                        request_id=out.request_id,
                        token_ids=list(new),
                        text=text,
                        finish_reason=out.finish_reason,
                        output=out if out.finished else None,
                    )
        except KeyboardInterrupt:
            self._shutdown(graceful=False)
            raise

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns outputs in prompt order.

        prompts: a string, a list of strings (needs tokenizer.json), or a list of token-id lists.
        sampling_params: one for all prompts, or one per prompt. `metrics()` then summarises
        the call (throughput, TTFT/TBT percentiles, KV usage, batch sizes).
        """
        self.reset_metrics()
        rids = self.submit(prompts, sampling_params)
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        index = {rid: i for i, rid in enumerate(rids)}
        outputs: list[RequestOutput | None] = [None] * len(rids)
        left = len(rids)
        finished: list[RequestOutput] = []
        try:
            with tqdm(total=len(rids), desc="generate", unit="req", disable=not show) as bar:
                while left:  # (only finished outputs matter here: no per-token deltas)
                    self._pump(None, None, finished)
                    for out in finished:
                        i = index.get(out.request_id)
                        if i is not None:  # (else another caller's request)
                            outputs[i] = out
                            left -= 1
                            bar.update(1)
                    finished.clear()
        except KeyboardInterrupt:
            self._shutdown(graceful=False)
            raise
        return outputs

    def warm_up(self, decode_steps: int = 16, prefill_repeats: int = 3) -> dict:
        """Runs made-up requests through the engine at the shapes serving will meet, so that
        what is settled by measurement on the first calls of a shape class (on CPU the kernel
        choices of `splitmoe.kernels.cpu_choice`, which time every candidate in place) is
        settled now rather than in the first clients' steps. Like vLLM's start-up warm-up.

        Each attention rank decodes ``b`` requests for ``decode_steps`` steps at every power
        of two ``b`` up to ``max_num_seqs`` and at three quarters of each (the MoE layouts'
        classes are half an octave wide: `half_octave_bucket`), then prefills one prompt of
        each power of two from
        32 tokens up to the step's token budget (``max_num_batched_tokens``, or the longest
        prompt that fits) ``prefill_repeats`` times. A class decided on an earlier start (the
        choices' cache file) costs its normal time. Greedy, random token ids (each request its
        own, so nothing is served from the prefix cache), then `reset_metrics`. Returns what
        ran: ``decode_batches``, ``prefill_tokens``, ``seconds``."""
        cfg = self.config
        ranks, vocab = cfg.parallel.attention_ranks, cfg.model.vocab_size
        longest = min(cfg.scheduler.max_num_batched_tokens, cfg.max_model_len - 1)
        top = cfg.scheduler.max_num_seqs
        batches = sorted({c for c in map(half_octave_bucket, range(1, top + 1)) if c <= top})
        prefills = [1 << i for i in range(5, longest.bit_length()) if 1 << i <= longest]
        prompt = 16
        rng = random.Random(0)

        def ids(n: int) -> list[int]:
            return [rng.randrange(1, vocab) for _ in range(n)]

        t0 = time.perf_counter()
        steps = min(decode_steps, cfg.max_model_len - prompt)
        if steps > 0:
            decode = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
            for b in batches:
                self.generate([ids(prompt) for _ in range(b * ranks)], decode, use_tqdm=False)
        once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for n in prefills:
            for _ in range(prefill_repeats):
                self.generate([ids(n) for _ in range(ranks)], once, use_tqdm=False)
        self.reset_metrics()
        return dict(
            decode_batches=batches if steps > 0 else [],
            prefill_tokens=prefills,
            seconds=time.perf_counter() - t0,
        )

    def stats(self, timeout: float | None = None) -> list[dict]:
        """A snapshot from every rank, in rank order: role, resident memory (``rss_mb``,
        ``peak_rss_mb``), KV blocks / running / waiting / preemptions and the backends (attention
        ranks), tokens served
        (expert ranks), and the transport's counters under ``"comm"``. With fault tolerance,
        only the ranks still in the job answer, each with ``"membership"``: the ranks (as at
        start-up) in the job now and the recoveries so far."""
        return self._ask("stats", timeout)

    def latest_stats(self) -> list[dict]:
        """Each rank's latest published counters, in rank order (ranks that have not published
        yet left out), without asking any rank: `stats`' keys but ``"comm"`` and
        ``"balancer"``, plus ``"published_at"`` (the rank's ``time.time()`` when it took them).
        Ranks publish while their counters change, about once a second, and soon (~0.1 s)
        after a request arrives or is aborted and after the job goes idle
        (`runtime.STATS_PUBLISH_S`); they arrive while this `LLM` is polled. Safe to call from
        any thread (a server's event loop) while another one polls."""
        return list(self._snapshots)

    def _keep_snapshot(self, rank: int, counters: dict) -> None:
        if rank in self._lost:  # (read late, from a rank the job has lost)
            return
        by_rank = {s["rank"]: s for s in self._snapshots}
        by_rank[rank] = counters
        self._snapshots = tuple(by_rank[r] for r in sorted(by_rank))

    def trace(self, timeout: float | None = None) -> list[dict]:
        """Every rank's recent timeline (``{"rank", "role", "timeline": [Span]}``, rank order):
        what it computed, sent and waited for in its last steps (see `splitmoe.timeline`)."""
        return self._ask("trace", timeout)

    def _ask(self, command: str, timeout: float | None) -> list[dict]:
        if not self._procs:
            raise RuntimeError("this LLM is closed; create a new one")
        self._stats = {}
        for r in reversed(range(len(self._to_rank))):
            if r not in self._lost:
                self._to_rank[r].put((command,))
        deadline = time.monotonic() + (
            self.config.parallel.timeout_s if timeout is None else timeout
        )
        while any(r not in self._stats for r in self._live_ranks()):
            self._await_answer(deadline, "answer a stats request")
        return [self._stats[r] for r in self._live_ranks()]

    def _live_ranks(self) -> list[int]:
        """Ranks (as at start-up) still in the job: all but those a fault-tolerant job lost."""
        return [r for r in range(len(self._to_rank)) if r not in self._lost]

    def rebalance(self, timeout: float | None = None) -> dict:
        """Recomputes the expert placement from the load observed since the last rebalance and
        applies it on every rank between two steps (requests keep running; no output token
        changes). Returns the new placement: ``{"placement_version", "slot_expert": {layer:
        [expert of each slot]}, ...}``. Colocated jobs have nothing to move (returns ``{}``)."""
        if not self._procs:
            raise RuntimeError("this LLM is closed; create a new one")
        self._stats = {}
        attention = [r for r in range(self.config.parallel.attention_ranks) if r not in self._lost]
        asker = attention[0]  # one rank asks; the control plane tells all
        self._to_rank[asker].put(("rebalance",))
        for r in attention[1:]:
            self._to_rank[r].put(("wake",))
        deadline = time.monotonic() + (
            self.config.parallel.timeout_s if timeout is None else timeout
        )
        while asker not in self._stats:
            self._await_answer(deadline, "finish a rebalance")
        return self._stats.pop(asker).get("stats") or {}

    def _await_answer(self, deadline: float, what: str) -> None:
        """Reads the ranks' messages until one came or ``deadline`` passed (then fails the
        job); step progress read meanwhile waits for the next `poll`."""
        progress: list = []
        self._pump(max(0.0, deadline - time.monotonic()), progress, [])
        self._backlog += progress
        if time.monotonic() >= deadline and not progress:
            self._fail(f"ranks did not {what} in time")

    def expert_load(self, timeout: float | None = None) -> dict:
        """Load statistics: pairs (token, expert) routed to each expert of each MoE layer,
        summed over the attention ranks: ``{"layers": [...], "total": [[...] per layer],
        "window": [...] (since the last rebalance), "slot_expert": {layer: [...]},
        "placement_version": int}``. Empty when colocated."""
        snaps = [s.get("balancer") for s in self.stats(timeout)]
        snaps = [s for s in snaps if s]
        if not snaps:
            return {}
        loads = [s["load"] for s in snaps if "load" in s]
        out = {
            "layers": loads[0]["layers"],
            "placement_version": snaps[0]["placement_version"],
            "slot_expert": snaps[0]["slot_expert"],
        }
        for key in ("total", "window"):
            out[key] = [[sum(v) for v in zip(*rows)] for rows in zip(*(ld[key] for ld in loads))]
        return out

    def reset_metrics(self) -> None:
        """Starts a new measurement period for `metrics`."""
        self._finished = []
        self._steps = []
        self._last_step = {}
        self._metrics_start = time.time()

    def metrics(self) -> ServingMetrics:
        """Serving metrics over the requests finished since `reset_metrics` (each `generate`
        call starts a new period)."""
        steps = self._steps
        end = max(
            (o.metrics.arrival_time + o.metrics.e2e_latency for o in self._finished),
            default=self._metrics_start,
        )
        return summarize(self._finished, steps, end - self._metrics_start)

    @property
    def step_records(self) -> list[StepRecord]:
        """Every executed step of every attention rank since `reset_metrics`."""
        return list(self._steps)


def _kill_all(procs: list[mp.Process], in_qs: list) -> None:
    """Stops the ranks, then lets this process exit without flushing what their queues still
    hold: by default its exit waits until every message put reaches the rank's pipe, which a
    stopped rank no longer drains."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    for q in in_qs:
        q.cancel_join_thread()
        q.close()
