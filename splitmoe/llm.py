"""The Python API: `LLM` starts the attention and expert ranks as processes and feeds them.

```python
from splitmoe import LLM, SamplingParams
with LLM(path, attention_ranks=1, expert_ranks=2, dtype="float32", device="cpu") as llm:
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
```

A thin layer: requests are checked here, then `engine.client.EngineClient` carries them to the
ranks in the messages of `engine.protocol` and brings their tokens back.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

from tqdm import tqdm

from splitmoe.config import EngineConfig
from splitmoe.engine.client import EngineClient, RankFailure
from splitmoe.engine.output import Detokenizer
from splitmoe.engine.procs import LaunchedJob, check_not_bootstrapping
from splitmoe.engine.warmup import warm_up
from splitmoe.inputs import broadcast_params, check_request, normalize_prompts
from splitmoe.metrics import ServingMetrics, StepRecord, summarize
from splitmoe.options import engine_config
from splitmoe.outputs import RequestOutput, StreamDelta
from splitmoe.sampling_params import SamplingParams
from splitmoe.tokenizer import Tokenizer

__all__ = ["LLM", "LaunchedJob", "RankFailure"]

RankFailure.__module__ = __name__  # (its public home: tracebacks and pickles name it so)


class LLM:
    """Starts ``attention_ranks + expert_ranks`` rank processes and serves `generate` calls.

    Options are those of the config dataclasses (`splitmoe.options.engine_options`: the same as
    the launcher's and the server's flags, each documented there); an unknown one is a
    TypeError. ``model``: an HF-format checkpoint directory (config.json + *.safetensors
    [+ tokenizer.json]), or an `EngineConfig` built already (then no options)."""

    def __init__(
        self,
        model: str | EngineConfig,
        *,
        launched: LaunchedJob | None = None,
        tokenizer: Tokenizer | None = None,
        **options,
    ):
        check_not_bootstrapping()
        self.engine: EngineClient | None = None
        if isinstance(model, EngineConfig):
            if options:
                raise TypeError("LLM(config): the options are the config's already")
            self.config = model
        else:
            self.config = engine_config(model, **options)
        path = self.config.model.path
        # Reads and checks every tensor header, and each rank's bytes against the device
        # memory (`splitmoe.memory`), before any rank starts.
        from splitmoe.memory import check_fits
        from splitmoe.models.loader import CheckpointReader

        CheckpointReader(path)
        check_fits(self.config, local_ranks=1 if launched is not None else None)
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_checkpoint(path)
        self._metrics_start = 0.0
        self.engine = EngineClient(self.config, self.tokenizer, launched)
        self.reset_metrics()

    # ---- lifetime ------------------------------------------------------------------------------

    def _live_engine(self) -> EngineClient:
        if self.engine is None or self.engine.procs is None:
            raise RuntimeError("this LLM is closed; create a new one")
        return self.engine

    def close(self) -> None:
        """Stops every rank; safe to call twice."""
        if self.engine is not None:
            self.engine.shutdown(graceful=True)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.engine is not None:
            self.engine.shutdown(graceful=exc_type is None)

    @property
    def rank_pids(self) -> list[int]:
        """The process ids of the ranks this `LLM` started, in rank order."""
        procs = self.engine.procs if self.engine is not None else None
        return [p.pid for p in procs.procs] if procs is not None else []

    # ---- requests ------------------------------------------------------------------------------

    def submit(self, prompts, sampling_params=None) -> list[int]:
        """Checks and sends requests to the attention ranks without waiting; returns their
        request ids. Results come from `poll` (or use `generate` / `stream`)."""
        engine = self._live_engine()
        ids = normalize_prompts(prompts, self.tokenizer)
        params = broadcast_params(sampling_params, len(ids))
        for i, (p, sp) in enumerate(zip(ids, params)):
            check_request(i, p, sp, self.config)
            if sp.stop and self.tokenizer is None:
                raise ValueError(
                    "stop strings need the checkpoint's tokenizer.json (they are matched on the "
                    "decoded text); use stop_token_ids"
                )
        return engine.submit(list(zip(ids, params)))

    def poll(
        self, timeout: float | None = None, every_step: bool = True
    ) -> list[tuple[RequestOutput, list[int]]]:
        """Waits for the next step's progress (up to ``timeout`` s, or the ranks' silence
        bound, or until `wake`); returns ``(output so far, new token ids)`` per request that
        advanced. With ``every_step`` False only finished requests come back (with no new
        tokens), and the ranks hold their steps back until a request finishes, which spares
        the cores this process shares with them. A failed rank raises `RankFailure` here."""
        got = self._live_engine().poll(timeout, every_step)
        return got.advanced if every_step else [(out, []) for out in got.finished]

    def abort(self, request_ids: list[int]) -> None:
        """Stops these requests on their attention ranks, which free their KV blocks at once;
        each comes back from `poll` finished with ``finish_reason="abort"`` (ids that already
        finished are ignored)."""
        self._live_engine().abort(request_ids)

    def wake(self) -> None:
        """Makes a `poll` that waits in another thread return now (thread-safe)."""
        if self.engine is not None:
            self.engine.wake()

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt (a string, a list of strings: needs tokenizer.json, or a
        list of token-id lists); returns outputs in prompt order. ``sampling_params``: one for
        all prompts, or one per prompt. `metrics` then summarises the call."""
        self.reset_metrics()
        rids = self.submit(prompts, sampling_params)
        index = {rid: i for i, rid in enumerate(rids)}
        outputs: list[RequestOutput | None] = [None] * len(rids)
        left = len(rids)
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        try:
            with tqdm(total=len(rids), desc="generate", unit="req", disable=not show) as bar:
                while left:  # (only finished outputs matter here: no per-token deltas)
                    for out, _ in self.poll(every_step=False):
                        i = index.get(out.request_id)
                        if i is not None:  # (else another caller's request)
                            outputs[i] = out
                            left -= 1
                            bar.update(1)
        except KeyboardInterrupt:
            self.engine.shutdown(graceful=False)
            raise
        return outputs

    def stream(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> Iterator[StreamDelta]:
        """Generates like `generate`, yielding a `StreamDelta` as each token is produced."""
        rids = self.submit(prompts, sampling_params)
        index = {rid: i for i, rid in enumerate(rids)}
        detok = {rid: Detokenizer(self.tokenizer) for rid in rids}
        pending = set(rids)
        try:
            while pending:
                for out, new in self.poll():
                    if out.request_id not in index:
                        continue  # another caller's request
                    text = detok[out.request_id].delta(out) if self.tokenizer else ""
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
            self.engine.shutdown(graceful=False)
            raise

    def warm_up(self, decode_steps: int = 16, prefill_repeats: int = 3) -> dict:
        """Runs made-up requests at the shapes serving will meet (`engine.warmup.warm_up`)."""
        return warm_up(self, decode_steps, prefill_repeats)

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not finished yet."""
        return len(self.engine.requests) if self.engine is not None else 0

    # ---- what the ranks tell -------------------------------------------------------------------

    def stats(self, timeout: float | None = None) -> list[dict]:
        """A snapshot from every rank still in the job, in rank order: role, memory, KV blocks,
        backends, tokens served, the transport's counters (``"comm"``); with fault tolerance,
        each with ``"membership"``."""
        return [a.stats for a in self._live_engine().ask("stats", timeout)]

    def latest_stats(self) -> list[dict]:
        """Each rank's latest published counters, in rank order, without asking any rank
        (`stats`' keys but ``"comm"`` and ``"balancer"``, plus ``"published_at"``); they arrive
        while this `LLM` is polled. Safe to call from any thread."""
        return list(self.engine.snapshots) if self.engine is not None else []

    def trace(self, timeout: float | None = None) -> list[dict]:
        """Every rank's recent timeline (``{"rank", "role", "timeline": [Span]}``, rank order)."""
        answers = self._live_engine().ask("trace", timeout)
        return [{"rank": a.rank, "role": a.role, "timeline": a.timeline} for a in answers]

    def rebalance(self, timeout: float | None = None) -> dict:
        """Recomputes the expert placement from the load observed since the last rebalance and
        applies it on every rank between two steps (requests keep running; no output token
        changes). Returns the new placement (``{}`` for a colocated job: nothing to move)."""
        return self._live_engine().rebalance(timeout) or {}

    def expert_load(self, timeout: float | None = None) -> dict:
        """Pairs (token, expert) routed to each expert of each MoE layer, summed over the
        attention ranks: ``{"layers", "total", "window" (since the last rebalance),
        "slot_expert", "placement_version"}``. Empty when colocated."""
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

    @property
    def health(self) -> str:
        """``"ok"``, or ``"degraded"`` while the job recovers from a lost rank."""
        return self.engine.health if self.engine is not None else "ok"

    @property
    def recoveries(self) -> list[dict]:
        """Each recovery from lost ranks (fault tolerance): ``lost`` and ``members`` (ranks as
        at start-up), ``seconds``, ``weights_read``, ``placement_version``, ``expert_slots``."""
        return list(self.engine.recoveries) if self.engine is not None else []

    # ---- metrics -------------------------------------------------------------------------------

    def reset_metrics(self) -> None:
        """Starts a new measurement period for `metrics`."""
        self.engine.reset()
        self._metrics_start = time.time()

    def metrics(self) -> ServingMetrics:
        """Serving metrics over the requests finished since `reset_metrics` (each `generate`
        call starts a new period)."""
        finished = self.engine.finished
        end = max(
            (o.metrics.arrival_time + o.metrics.e2e_latency for o in finished),
            default=self._metrics_start,
        )
        return summarize(finished, self.engine.steps, end - self._metrics_start)

    @property
    def step_records(self) -> list[StepRecord]:
        """Every executed step of every attention rank since `reset_metrics`."""
        return list(self.engine.steps)

    @property
    def last_steps(self) -> dict[int, StepRecord]:
        """Each attention rank's most recent `StepRecord`."""
        return dict(self.engine.last_step)
