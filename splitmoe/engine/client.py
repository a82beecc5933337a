"""The front end's side of a job: its rank processes, one socket to every rank, and what it
knows of each live request (`RequestState`).

`EngineClient` sends `protocol` commands and reads reports. It is single-threaded by design
(one caller: `LLM`, or the server's engine thread); `wake` alone may be called from another
thread. A rank that fails, dies or stops answering fails the job with `RankFailure` naming it,
unless the job runs fault-tolerant and can go on without it (docs/fault_tolerance.md): then
the survivors rebuild the job, the client ends the lost rank's process, resumes its requests
on the others and keeps serving.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace

from splitmoe.comm.distributed import hosted_store
from splitmoe.config import EngineConfig
from splitmoe.engine.output import StopWatch, front_end_fault
from splitmoe.engine.procs import LaunchedJob, RankProcesses
from splitmoe.engine.protocol import (
    AbortRequests,
    AddRequests,
    Close,
    Command,
    Evicted,
    Exited,
    Follow,
    RankError,
    Ready,
    RebalanceDone,
    RebalanceQuery,
    Recovered,
    Report,
    Snapshot,
    StatsQuery,
    StatsReply,
    StepOutput,
    TraceQuery,
    TraceReply,
    Wake,
)
from splitmoe.engine.transport import FrontEndSocket, reachable_address
from splitmoe.metrics import StepRecord
from splitmoe.outputs import RequestOutput
from splitmoe.scheduler.block_manager import block_hashes
from splitmoe.scheduler.request import RequestSpec
from splitmoe.scheduler.router import LeastLoadRouter

logger = logging.getLogger("splitmoe")


class RankFailure(RuntimeError):
    """A rank process raised or died; the whole job was stopped. ``public``: what a client may
    read of it (which ranks failed or died; never a traceback, a path or an exception's
    text)."""

    def __init__(self, message: str, public: str = "internal error"):
        super().__init__(message)
        self.public = public


def recovery_bound_s(timeout_s: float) -> float:
    """How long a fault-tolerant job's survivors may take to go on without a lost rank: up to
    ``timeout_s`` to notice one that stopped answering, up to 1.5 more to agree without it
    (`agree_membership`), then rebuild, read weights and replay; past it the front end gives
    up on them."""
    return 3 * timeout_s + 10


@dataclass
class RequestState:
    """What the front end knows of one live request; dropped whole when it finishes."""

    spec: RequestSpec
    output: RequestOutput
    stop: StopWatch | None = None  # its stop strings, matched on the decoded text
    aborted: bool = False  # an abort was asked (its rank answers it)
    fault: str | None = None  # it failed here (its rank was told to abort it)

    @property
    def rank(self) -> int:
        return self.output.attention_rank


@dataclass
class Progress:
    """What one read of the ranks brought: ``advanced`` (request output, new token ids), one
    entry per request however many of its steps the read took in, and the outputs that
    ``finished``."""

    advanced: list[tuple[RequestOutput, list[int]]] = field(default_factory=list)
    finished: list[RequestOutput] = field(default_factory=list)
    _at: dict[int, int] = field(default_factory=dict)  # id(output) -> its entry in `advanced`

    def advance(self, out: RequestOutput, new: list[int]) -> None:
        i = self._at.get(id(out))
        if i is None:
            self._at[id(out)] = len(self.advanced)
            self.advanced.append((out, new))
        else:  # (a later step of the same request: its tokens join the entry)
            self.advanced[i] = (out, self.advanced[i][1] + new)


class EngineClient:
    def __init__(self, config: EngineConfig, tokenizer, launched: LaunchedJob | None = None):
        self.config = config
        self.tokenizer = tokenizer
        par = config.parallel
        self.requests: dict[int, RequestState] = {}
        self.snapshots: tuple[dict, ...] = ()  # each rank's latest published counters
        self.recoveries: list[dict] = []
        self.lost: dict[int, float] = {}  # rank (as at start-up) -> time.monotonic() seen
        self.moved: set[int] = set()  # lost attention ranks whose requests were resumed
        self.steps: list[StepRecord] = []  # every step since `reset` (for `metrics`)
        self.finished: list[RequestOutput] = []
        self.last_step: dict[int, StepRecord] = {}
        self.backlog = Progress()  # read while a query waited: the next `poll` returns it
        self._answers: dict[int, dict[int, Report]] = {}  # query id -> rank -> answer
        self._next_id = self._next_query = 0
        self._every_step = True
        cache = config.cache
        blocks = cache.resolve_num_blocks(
            config.model, config.torch_dtype, config.scheduler.max_num_seqs, config.max_model_len
        )
        routed = blocks if cache.enable_prefix_caching and par.attention_ranks > 1 else 0
        self.router = LeastLoadRouter(par.attention_ranks, routed)
        if launched is None:
            # the rendezvous store is bound here, on a port the OS picks, before any rank
            # starts (a port picked free and bound later can be taken meanwhile); with fault
            # tolerance it must also outlive any rank
            self._store, init_method = hosted_store("127.0.0.1", par.timeout)
            self.socket = FrontEndSocket()
        else:
            self._store, init_method = None, launched.init_method
            self.socket = FrontEndSocket(reachable_address(_master_host(init_method)))
        self.procs = RankProcesses(
            config, init_method, self.socket.address, self.socket.token, launched
        )
        self._launched = launched
        self._wait_ready()

    # ---- start and failures --------------------------------------------------------------------

    def _wait_ready(self) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + self.config.parallel.timeout_s + 60
        while len(ready) < self.config.parallel.world_size:
            for rank, report in self._read(deadline, "start-up"):
                if self._keep(rank, report) and isinstance(report, Ready):
                    ready.add(rank)

    def role(self, rank: int) -> str:
        return "attention" if rank < self.config.parallel.attention_ranks else "expert"

    def _read(self, deadline: float, what: str, fail: bool = True) -> list[tuple[int, Report]]:
        """The next reports of the ranks, in arrival order (the caller hands each to `_keep`
        in turn before it uses it: a report can change what the next one means); an empty
        list past ``deadline`` when not ``fail``, or when `wake` was called. A dead rank stops
        the job (unless the job goes on without it)."""
        while True:
            left = max(0.0, min(0.1, deadline - time.monotonic()))
            reports, woken = self.socket.receive(left)
            if reports or woken:
                return reports
            self._watch(what)
            if time.monotonic() >= deadline:
                if not fail:
                    return []
                self.fail(
                    f"no progress from the ranks for too long during {what}",
                    "the ranks stopped answering",
                )
            if fail and self.health == "degraded" and self.lost:
                # the survivors may first notice at their timeout, then agree within another
                deadline = max(deadline, min(self.lost.values()) + self._silence_s())

    def _keep(self, rank: int, report: Report) -> bool:
        """Handles what the client keeps for itself; True for what its caller wants."""
        if isinstance(report, Snapshot):
            if rank not in self.lost:  # (read late, from a rank the job has lost)
                by_rank = {s["rank"]: s for s in self.snapshots}
                by_rank[rank] = report.counters
                self.snapshots = tuple(by_rank[r] for r in sorted(by_rank))
            return False
        if isinstance(report, Recovered):
            self._note_recovery(report.membership)
            return False
        if isinstance(report, Evicted):  # (woke after its peers went on without it)
            logger.warning("rank %d (%s): %s", rank, report.role, report.message)
            self.lost.setdefault(rank, time.monotonic())
            self.procs.end(rank)
            return False
        if isinstance(report, RankError):
            if rank in self.evicted():
                logger.warning("rank %d, left out of the job, failed: %s", rank, report.message)
                return False
            died = self.procs.died(exclude={rank, *self.evicted()})
            cause = f"{died}; then " if died else ""
            self.fail(
                f"{cause}rank {rank} ({report.role}) failed: {report.message}\n"
                f"--- rank {rank} traceback ---\n{report.traceback}",
                f"{cause}rank {rank} ({report.role}) failed",
            )
        if isinstance(report, Exited):
            return False
        if isinstance(report, StepOutput) and rank in self.moved:
            return False  # (late words of a lost rank: its requests moved)
        if isinstance(report, (StatsReply, TraceReply, RebalanceDone)):
            self._answers.setdefault(report.id, {})[rank] = report
            return True
        return True

    def _watch(self, what: str) -> None:
        """Ranks of this host that exited: a lost rank the job survives, or its failure."""
        exited = [r for r in self.procs.exited() if r not in self.evicted()]
        if not exited:
            return
        if self._survivable(exited, what):
            for r in exited:
                if r not in self.lost:
                    logger.warning(
                        "rank %d (%s) exited; the job recovers without it", r, self.role(r)
                    )
                    self.lost[r] = time.monotonic()
            return
        died = self.procs.died(exclude=self.evicted(), grace_s=0)
        hint = self.procs.spawn_failure_hint() if what == "start-up" else ""
        self.fail(f"{died or 'a rank exited early'} during {what}{hint}", died or "a rank exited")

    def _survivable(self, exited: list[int], what: str) -> bool:
        """With fault tolerance, whether the job can go on without ``exited``: at least one
        attention and one expert rank (if it had any) still run. (Launched jobs: the launcher
        stops every rank when one exits; rank 0's loss is not survived there.)"""
        par = self.config.parallel
        if not par.fault_tolerance or what == "start-up":
            return False
        if self._launched is not None and 0 in exited:
            return False
        roles = {self.role(r) for r in range(par.world_size) if r not in exited}
        return "attention" in roles and (not par.expert_ranks or "expert" in roles)

    def _note_recovery(self, membership: dict) -> None:
        for rec in membership["recoveries"][len(self.recoveries) :]:
            seen = [self.lost[r] for r in rec["lost"] if r in self.lost]
            rec = dict(rec, noticed_s_ago=time.monotonic() - min(seen) if seen else None)
            self.recoveries.append(rec)
            for r in rec["lost"]:  # (one left out while still running: silent past timeout_s)
                self.lost.setdefault(r, time.monotonic())
                if self.procs.end(r):
                    logger.warning("rank %d (%s), left out by its peers, is ended", r, self.role(r))
                if self.role(r) == "attention":
                    self._resume_lost(r)
        # (a lost rank's last counters would show its blocks held for ever)
        self.snapshots = tuple(s for s in self.snapshots if s["rank"] not in self.lost)

    def evicted(self) -> set[int]:
        """Ranks (as at start-up) that a recovery left out."""
        return {r for rec in self.recoveries for r in rec["lost"]}

    def _resume_lost(self, rank: int) -> None:
        """Moves a lost attention rank's unfinished requests to the surviving ones: each
        resumes from its prompt plus the tokens received here, as a preempted request does, so
        a stream goes on with no token repeated or missing (docs/fault_tolerance.md)."""
        self.moved.add(rank)
        self.router.retire(rank)
        moved: dict[int, list[RequestSpec]] = {}
        again: dict[int, list[int]] = {}
        for rid, st in self.requests.items():
            if st.rank != rank:
                continue
            tokens = st.output.token_ids
            new = self._route(st.spec, len(st.spec.prompt_token_ids) + len(tokens))
            params = st.spec.params
            if params.kv_transfer_params is not None:  # (computed here: the pull is over)
                params = replace(params, kv_transfer_params=None)
            moved.setdefault(new, []).append(
                replace(st.spec, params=params, output_token_ids=list(tokens))
            )
            st.output.attention_rank = new
            if st.aborted or st.fault or (st.stop and st.stop.hit):
                again.setdefault(new, []).append(rid)
        for new, specs in moved.items():
            logger.warning(
                "%d request(s) of lost attention rank %d resume on rank %d", len(specs), rank, new
            )
            self.send(new, AddRequests(specs))
            if new in again:
                self.send(new, AbortRequests(again[new]))

    @property
    def health(self) -> str:
        """``"ok"``, or ``"degraded"`` from when a rank is seen gone until its peers report
        that they go on without it."""
        return "degraded" if set(self.lost) - self.evicted() else "ok"

    def _silence_s(self) -> float:
        """How long the ranks may stay silent before the job fails: the collective timeout;
        with fault tolerance, the bound of a recovery (`recovery_bound_s`)."""
        par = self.config.parallel
        return recovery_bound_s(par.timeout_s) if par.fault_tolerance else par.timeout_s

    def fail(self, message: str, public: str = "internal error"):
        self.shutdown(graceful=False)
        raise RankFailure(message, public) from None

    def live_ranks(self) -> list[int]:
        return [r for r in range(self.config.parallel.world_size) if r not in self.lost]

    def send(self, rank: int, command: Command) -> None:
        """(A rank that cannot be reached is gone: `_watch` or its peers tell.)"""
        self.socket.send(rank, command)

    def wake(self) -> None:
        self.socket.wake()

    # ---- requests ------------------------------------------------------------------------------

    def submit(self, specs: list[tuple[list[int], object]]) -> list[int]:
        """Sends checked ``(prompt ids, SamplingParams)`` pairs to the attention ranks."""
        now = time.time()
        batches: dict[int, list[RequestSpec]] = {}
        rids = []
        for prompt, params in specs:
            rid, self._next_id = self._next_id, self._next_id + 1
            spec = RequestSpec(rid, list(prompt), params, now)
            rank = self._route(spec, len(prompt))
            batches.setdefault(rank, []).append(spec)
            out = RequestOutput(
                request_id=rid,
                prompt_token_ids=spec.prompt_token_ids,
                attention_rank=rank,
                logprobs=None if params.logprobs is None else [],
            )
            stop = None
            if params.stop:
                stop = StopWatch(self.tokenizer, params.stop, params.min_tokens)
            self.requests[rid] = RequestState(spec, out, stop)
            rids.append(rid)
        for rank in range(self.config.parallel.attention_ranks):
            if rank not in self.lost:  # (idle ranks join the next step now)
                batch = batches.get(rank)
                self.send(rank, AddRequests(batch) if batch else Wake())
        return rids

    def _route(self, spec: RequestSpec, cost: int) -> int:
        hashes = ()
        if self.router.capacity:
            bs = self.config.cache.block_size
            hashes = block_hashes(spec.prompt_token_ids, bs, salt=spec.params.cache_salt)
        return self.router.pick(cost, hashes)

    def abort(self, request_ids: list[int]) -> None:
        by_rank: dict[int, list[int]] = {}
        for rid in request_ids:
            st = self.requests.get(rid)
            if st is not None:
                by_rank.setdefault(st.rank, []).append(rid)
                st.aborted = True
        for rank, rids in by_rank.items():
            self.send(rank, AbortRequests(rids))

    def poll(self, timeout: float | None, every_step: bool) -> Progress:
        """The next step's progress, up to ``timeout`` s (None: the ranks' silence bound, then
        `RankFailure`) or `wake`. With ``every_step`` False the ranks hold step outputs back
        until a request finishes (the caller wants finished ones only)."""
        if self.backlog.advanced or self.backlog.finished:
            got, self.backlog = self.backlog, Progress()
            return got
        self._follow(every_step)
        got = Progress()
        deadline = time.monotonic() + (self._silence_s() if timeout is None else timeout)
        while not (got.advanced or got.finished):
            reports = self._read(deadline, "generate", fail=timeout is None)
            if not reports:
                return got
            for rank, report in reports:
                if self._keep(rank, report) and isinstance(report, StepOutput):
                    self._apply(rank, report, got)
            if time.monotonic() >= deadline:
                return got
        return got

    def _follow(self, every_step: bool) -> None:
        if every_step != self._every_step:
            self._every_step = every_step
            for rank in range(self.config.parallel.attention_ranks):
                if rank not in self.lost:
                    self.send(rank, Follow(every_step))

    def _apply(self, rank: int, step: StepOutput, got: Progress) -> None:
        """One step's tokens into the live requests. A fault in one request's stop-string
        check fails that request alone: it is aborted on its rank and finishes with
        ``"error"`` when the rank confirms, reporting nothing more until then."""
        if step.record is not None:  # (None: refused or aborted requests, outside a step)
            self.steps.append(step.record)
            self.last_step[rank] = step.record
        logprobs = step.logprobs
        reported = set()
        for j, (rid, new) in enumerate(zip(step.request_ids, step.new_tokens)):
            st = self.requests[rid]
            out = st.output
            out.token_ids.extend(new)
            if logprobs is not None and logprobs[j]:
                out.logprobs.extend(logprobs[j])
            if st.fault is not None:
                continue
            if st.stop is not None:
                try:
                    hit = st.stop.check(out)
                except Exception as e:
                    self._request_fault(st, "stop-string check", e)
                    continue
                if hit:
                    if st.stop.hit[0] == len(out.token_ids) and new:  # (it just appeared)
                        self.send(st.rank, AbortRequests([rid]))
                    continue  # (nothing past a stop string is reported)
            got.advance(out, new)
            reported.add(rid)
        self.router.add(rank, sum(map(len, step.new_tokens)))
        for f in step.finished:
            rid = step.request_ids[f.index]
            self._finish(rank, rid, f, got, reported=rid in reported)

    def _finish(self, rank: int, rid: int, f, got: Progress, reported: bool) -> None:
        st = self.requests.pop(rid)
        out = st.output
        self.router.release(rank, len(out.prompt_token_ids) + len(out.token_ids))
        reason, metrics, error = f.reason, f.metrics, f.error
        if st.fault is not None:  # (whatever the rank says: it failed here first)
            reason, error = "error", st.fault
        elif st.stop is not None and st.stop.hit is not None:
            n, out.text = st.stop.hit
            del out.token_ids[n:]
            if out.logprobs is not None:
                del out.logprobs[n:]
            reason, metrics = "stop", replace(metrics, num_output_tokens=n)
        elif self.tokenizer is not None:
            try:
                out.text = self.tokenizer.decode(out.token_ids)
            except Exception as e:
                reason, error = "error", front_end_fault(rid, "detokenizing", e)
        out.finish_reason, out.metrics, out.error = reason, metrics, error
        # (a request its client gave up on, or that failed, says nothing of speed)
        if reason not in ("abort", "error"):
            self.finished.append(out)
        if not reported:  # (its last tokens were held back: it ends with none new)
            got.advance(out, [])
        got.finished.append(out)

    def _request_fault(self, st: RequestState, stage: str, error: Exception) -> None:
        st.fault = front_end_fault(st.spec.request_id, stage, error)
        st.stop = None
        self.send(st.rank, AbortRequests([st.spec.request_id]))

    # ---- queries -------------------------------------------------------------------------------

    def ask(self, kind: str, timeout: float | None) -> list[Report]:
        """Every live rank's answer to a stats or trace query, in rank order."""
        qid = self._query()
        ranks = self.live_ranks()
        make = StatsQuery if kind == "stats" else TraceQuery
        for r in reversed(ranks):
            self.send(r, make(qid))
        self._await(qid, ranks, timeout, f"answer a {kind} request")
        answers = self._answers.pop(qid)
        return [answers[r] for r in self.live_ranks()]

    def rebalance(self, timeout: float | None) -> dict:
        qid = self._query()
        attention = [r for r in range(self.config.parallel.attention_ranks) if r not in self.lost]
        asker = attention[0]  # one rank asks; the step sync tells all
        self.send(asker, RebalanceQuery(qid))
        for r in attention[1:]:
            self.send(r, Wake())
        self._await(qid, [asker], timeout, "finish a rebalance")
        return self._answers.pop(qid)[asker].placement

    def _query(self) -> int:
        self._next_query += 1
        return self._next_query

    def _await(self, qid: int, ranks: list[int], timeout: float | None, what: str) -> None:
        """Reads until every rank of ``ranks`` (those still live) answered query ``qid``; step
        outputs read meanwhile wait in the backlog for the next `poll`."""
        wait = self.config.parallel.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + wait
        while any(r not in self._answers.get(qid, {}) and r not in self.lost for r in ranks):
            for rank, report in self._read(deadline, what):
                if self._keep(rank, report) and isinstance(report, StepOutput):
                    self._apply(rank, report, self.backlog)
            if time.monotonic() >= deadline:
                self.fail(f"ranks did not {what} in time", "the ranks stopped answering")

    # ---- the end -------------------------------------------------------------------------------

    def reset(self) -> None:
        self.finished, self.steps, self.last_step = [], [], {}

    def shutdown(self, graceful: bool) -> None:
        if self.procs is None:
            return
        procs, self.procs = self.procs, None
        if graceful:
            for r in reversed(self.live_ranks()):
                self.socket.send(r, Close())
            procs.join(30)
        procs.kill()
        self.socket.close()
        self._store = None  # (the rendezvous store's socket and thread go with it)


def _master_host(init_method: str) -> str:
    """The rendezvous host of a launcher's ``init_method`` (``env://``: MASTER_ADDR)."""
    if init_method.startswith("tcp://"):
        return init_method[len("tcp://") :].rsplit(":", 1)[0]
    return os.environ.get("MASTER_ADDR", "127.0.0.1")
