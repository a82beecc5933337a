"""The server's side of the engine: one thread owns the `LLM` and pumps it; asyncio handlers
hand it jobs and read their progress from asyncio queues.

The `LLM` front end is single-threaded by design (its ranks' pipes, its live outputs, its
router), so exactly one thread calls it: `AsyncEngine`'s. Handlers never block on it: a job is
put on a command queue and the thread is woken (`LLM.wake` ends a `poll` at once); progress comes
back in one `call_soon_threadsafe` per job and step. While no live job streams, the thread polls
with ``every_step=False`` and the ranks wake it only when a request finishes, as
`LLM.generate` does: waking the front end after every step takes the cores it shares with
ranks away from their decode.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace

from splitmoe.config import EngineConfig
from splitmoe.engine.client import RankFailure
from splitmoe.engine.output import TextStream
from splitmoe.engine.procs import LaunchedJob
from splitmoe.llm import LLM
from splitmoe.outputs import RequestOutput, request_error
from splitmoe.sampling_params import SamplingParams
from splitmoe.server.metrics import ServerMetrics
from splitmoe.tokenizer import Tokenizer

logger = logging.getLogger("splitmoe")

_IDLE_POLL_S = 0.5  # a poll's wait when nothing else wakes it (`LLM.wake` ends it early)
_RESET_EVERY = 4096  # finished requests after which the LLM's metric history is dropped


class EngineError(RuntimeError):
    """The engine cannot serve: a rank failed, it is still starting, or it shuts down."""


@dataclass
class Delta:
    """What a job's queue receives for one of its sequences: new tokens, their text and
    log-probabilities; ``output`` once the sequence finished (then ``finish_reason`` too)."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list | None = None
    finish_reason: str | None = None
    output: RequestOutput | None = None


@dataclass(eq=False)
class Job:
    """One API request: its prompts (token ids) and per-sequence params (``n`` copies of each
    prompt are separate sequences), where its progress goes, and whether it streams."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    stream: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_ids: list[int] = field(default_factory=list)
    done: bool = False

    def send(self, items) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, items)


@dataclass(frozen=True)
class _Submit:
    job: Job


@dataclass(frozen=True)
class _Abort:
    job: Job


@dataclass(frozen=True)
class _Stop:
    pass


class AsyncEngine:
    """Starts an `LLM` on its own thread and serves `Job`s through it.

    ``state``: ``"starting"`` until every rank is ready (with ``warmup``, and has run
    `LLM.warm_up`), then ``"ready"``; ``"failed"`` once a rank failed (``error`` says how; every
    live job got an `EngineError`), ``"stopped"`` after `stop`."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        metrics: ServerMetrics | None = None,
        launched: LaunchedJob | None = None,
        warmup: bool = False,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.warmup = warmup
        self.launched = launched
        self.metrics = metrics
        self.state = "starting"
        self.error: str | None = None  # how it failed, whole (for the log)
        self.public_error: str | None = None  # the same in one line, for clients
        self.llm: LLM | None = None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._seqs: dict[int, tuple[Job, int, TextStream | None]] = {}
        self._streaming = 0  # live sequences of streaming jobs
        self._finished_since_reset = 0
        self._recoveries_seen = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="splitmoe-engine", daemon=True)

    # ---- called from the event loop -----------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def submit(self, job: Job) -> None:
        if self.state != "ready":
            raise EngineError(self._unavailable())
        self._command(_Submit(job))

    def abort(self, job: Job) -> None:
        """The job's client went away: its sequences stop and free their KV blocks."""
        if not job.done:
            job.done = True
            self._command(_Abort(job))

    @property
    def health(self) -> str:
        """`state`, but ``"degraded"`` while a fault-tolerant job recovers from a lost rank
        (`LLM.health`): it keeps serving meanwhile."""
        llm = self.llm
        if self.state == "ready" and llm is not None and llm.health != "ok":
            return llm.health
        return self.state

    def latest_stats(self) -> list[dict]:
        """Each rank's latest published counters (`LLM.latest_stats`), read without a command
        to the engine thread and without waiting on any rank: what GET /metrics reads. Empty
        before the ranks started."""
        llm = self.llm
        return [] if llm is None else llm.latest_stats()

    def stop(self, timeout: float = 30.0) -> None:
        """Fails what still runs, stops every rank and joins the thread."""
        self._command(_Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _command(self, cmd) -> None:
        self._cmds.put(cmd)
        llm = self.llm
        if llm is not None:
            llm.wake()

    def _unavailable(self) -> str:
        if self.state == "starting":
            return "the model is still loading; retry when GET /health answers 200"
        if self.state == "failed":
            return f"the engine failed and serves no more requests: {self.public_error}"
        return "the server is shutting down"

    # ---- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.llm = LLM(self.config, launched=self.launched, tokenizer=self.tokenizer)
            if self.warmup:
                ran = self.llm.warm_up()
                logger.info("warmed up in %.1f s: %s", ran["seconds"], ran)
        except Exception as e:  # (bad options were checked before the server started)
            self._fail(f"start-up failed: {e}", "start-up failed")
            if self.llm is not None:  # (the warm-up failed: its ranks are stopped)
                self.llm.close()
            self._ready.set()
            return
        self.state = "ready"
        self._ready.set()
        llm = self.llm
        try:
            while self._handle_commands():
                progress = llm.poll(_IDLE_POLL_S, every_step=self._streaming > 0)
                if progress:
                    self._deliver(progress)
                recoveries = llm.recoveries  # (fault tolerance: lost ranks)
                if len(recoveries) > self._recoveries_seen:
                    for rec in recoveries[self._recoveries_seen :]:
                        logger.warning("recovered without rank(s) %s", rec["lost"])
                        if self.metrics is not None:
                            self.metrics.recovered(rec["seconds"])
                    self._recoveries_seen = len(recoveries)
        except RankFailure as e:
            self._fail(str(e), e.public)
            return
        except Exception as e:  # a bug here must not leave clients waiting forever
            logger.exception("engine thread failed")
            self._fail(f"internal error: {type(e).__name__}: {e}")
            llm.close()
            return
        self._fail_all("the server shut down before this request finished")
        self.state = "stopped"
        llm.close()

    def _handle_commands(self) -> bool:
        """Runs the queued commands; False once asked to stop."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return True
            if isinstance(cmd, _Submit):
                self._submit(cmd.job)
            elif isinstance(cmd, _Abort):  # (its sequences come back finished, "abort", unsent)
                self.llm.abort(cmd.job.request_ids)
            else:
                assert isinstance(cmd, _Stop), cmd
                return False

    def _submit(self, job: Job) -> None:
        if job.done:  # (its client left before it was submitted)
            return
        try:
            rids = self.llm.submit(job.prompts, job.params)
        except (ValueError, TypeError) as e:  # (the handlers validate first: a safety net)
            job.done = True
            job.send(e)
            return
        job.request_ids = rids
        tok = self.llm.tokenizer
        for i, (rid, params) in enumerate(zip(rids, job.params)):
            self._seqs[rid] = (job, i, TextStream(tok, params) if job.stream else None)
        if job.stream:
            self._streaming += len(rids)

    def _forget(self, rid: int) -> None:
        entry = self._seqs.pop(rid, None)
        if entry is not None and entry[2] is not None:
            self._streaming -= 1

    def _deliver(self, progress: list[tuple[RequestOutput, list[int]]]) -> None:
        by_job: dict[Job, list[Delta]] = {}
        now = time.time()
        for out, _ in progress:
            entry = self._seqs.get(out.request_id)
            if entry is None:
                continue  # (aborted)
            job, index, text = entry
            if out.finished:
                self._forget(out.request_id)
                if self.metrics is not None:
                    self.metrics.finished(out, now)
                self._finished_since_reset += 1
            if job.done or (text is None and not out.finished):
                continue
            if text is not None:
                try:
                    tokens, delta, lps = text.delta(out)
                except Exception as e:  # (fails this sequence alone)
                    by_job.setdefault(job, []).append(self._sequence_fault(out, index, e, now))
                    continue
            else:
                tokens, delta, lps = out.token_ids, out.text or "", out.logprobs
            by_job.setdefault(job, []).append(
                Delta(index, tokens, delta, lps, out.finish_reason, out if out.finished else None)
            )
        for job, deltas in by_job.items():
            job.send(deltas)
        if self._finished_since_reset >= _RESET_EVERY:  # (bounds the LLM's metric history)
            self.llm.reset_metrics()
            self._finished_since_reset = 0

    def _sequence_fault(
        self, out: RequestOutput, index: int, error: Exception, now: float
    ) -> Delta:
        """Building one sequence's delta raised: it fails alone (aborted on its rank if it still
        runs, which frees its blocks), with a final delta of reason ``"error"`` whose output
        (a copy: the live one changes until the abort lands) carries ``error``."""
        logger.error("request %d: building its stream delta failed", out.request_id, exc_info=error)
        failed = replace(
            out,
            token_ids=list(out.token_ids),
            logprobs=None if out.logprobs is None else list(out.logprobs),
            finish_reason="error",
            error=request_error("detokenizing", error),
        )
        if not out.finished:
            self._forget(out.request_id)
            self.llm.abort([out.request_id])
            if self.metrics is not None:
                self.metrics.finished(failed, now)
        return Delta(index, [], "", None, "error", failed)

    def _fail(self, message: str, public: str = "internal error") -> None:
        """``public``: what a client may read of it (never a traceback, a path or an
        exception's text: the log has those)."""
        self.state, self.error = "failed", message
        self.public_error = public
        logger.error("engine failed: %s", message)
        self._fail_all(f"the engine failed: {self.public_error}; the server log has the details")

    def _fail_all(self, message: str) -> None:
        jobs = {job for job, _, _ in self._seqs.values()}
        self._seqs.clear()
        self._streaming = 0
        while True:  # (jobs not submitted yet)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Submit):
                jobs.add(cmd.job)
        for job in jobs:
            job.done = True
            job.send(EngineError(message))
