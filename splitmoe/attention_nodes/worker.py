"""The attention rank's step: schedule, build the packed batch, run the model, sample."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from splitmoe.attention_nodes.compiled import CompiledPieces
from splitmoe.attention_nodes.grammar import GrammarBackend, GrammarState, apply_grammar_masks
from splitmoe.attention_nodes.graphs import DecodeGraphs
from splitmoe.attention_nodes.kv_cache import kv_pools
from splitmoe.attention_nodes.micro_batch import Lazy, select_rows, split_micro_batches
from splitmoe.attention_nodes.model import AttentionModel, MicroBatch
from splitmoe.attention_nodes.remote_experts import RemoteExperts
from splitmoe.attention_nodes.sampler import make_generator, sample, token_logprobs
from splitmoe.comm.transport import Transport
from splitmoe.config import EngineConfig
from splitmoe.cuda_graphs import graph_stats
from splitmoe.eplb.balancer import Balancer
from splitmoe.expert_nodes.experts import LocalExperts
from splitmoe.kernels.attention_metadata import AttentionMetadata
from splitmoe.kernels.backends import attention_backend, moe_backend
from splitmoe.kv_transfer.connectors import make_connector
from splitmoe.metrics import StepRecord
from splitmoe.models.loader import load_attention_weights
from splitmoe.outputs import RequestMetrics, request_error
from splitmoe.scheduler.block_manager import BlockManager
from splitmoe.scheduler.request import Request, RequestSpec
from splitmoe.scheduler.scheduler import ScheduledBatch, Scheduler
from splitmoe.timeline import Timeline

logger = logging.getLogger("splitmoe")


@dataclass
class RequestUpdate:
    """New tokens of one request from one step; ``metrics`` once it finished; ``error`` (with
    ``finish_reason="error"``) when handling this request alone raised: it failed, the others
    in its step did not."""

    request_id: int
    new_token_ids: list[int]
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None
    logprobs: list | None = None  # per new token, `sampler.token_logprobs`'s entry
    error: str | None = None


class AttentionWorker:
    def __init__(
        self,
        cfg: EngineConfig,
        transport: Transport | None,
        device: torch.device,
        rank: int = 0,
        balancer: Balancer | None = None,
    ):
        m = cfg.model
        self.rank = rank
        dtype = cfg.torch_dtype
        self.device = device
        self.seed = cfg.seed
        self.timeline = Timeline()
        globals_, layers = load_attention_weights(m, dtype, str(device))
        self.model = AttentionModel(
            m,
            globals_,
            layers,
            device,
            attention_backend(cfg.attention_backend, device),
            compile=cfg.compile_model,
        )
        self.experts = (
            LocalExperts(
                m, list(range(m.num_experts)), dtype, device, moe_backend(cfg.moe_backend, device)
            )
            if transport is None
            else RemoteExperts(transport, self.timeline, balancer)
        )
        block_size, sched = cfg.cache.block_size, cfg.scheduler
        self.kv_cache, self.window_blocks, num_blocks = kv_pools(cfg, device)
        n_sliding = len(m.sliding_layers)
        # A cached prefix holds the full-attention layers' blocks only: the sliding-window
        # layers' blocks of its last window are freed as it runs, so models with such layers
        # (GPT-OSS) run without prefix caching.
        prefix_caching = cfg.cache.enable_prefix_caching and not n_sliding
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        # CUDA graphs of decode steps, captured now, before any request (None: eager, on CPU);
        # colocated, of the local experts too
        if isinstance(self.experts, LocalExperts):
            self.experts.capture_graphs(cfg.cuda_graphs, sched.max_num_seqs, m.top_k)
        self.graphs = DecodeGraphs.create(
            self.model, self.kv_cache, device, cfg.cuda_graphs, sched.max_num_seqs,
            cfg.max_model_len, block_size,
        )  # fmt: skip
        kv = cfg.kv_transfer  # prefill-decode disaggregation (splitmoe.kv_transfer)
        self.kv_connector = make_connector(kv, self.kv_cache) if kv.kv_connector else None
        self.scheduler = Scheduler(
            cfg.scheduler,
            self.blocks,
            m.eos_token_ids,
            cfg.max_model_len,
            self.window_blocks,
            self.kv_connector,
        )
        self.generators: dict[int, torch.Generator | None] = {}
        # requests that failed on arrival (their generator could not be made): they fail at
        # their first sampling, where the step reports them (request id -> error)
        self._arrival_faults: dict[int, str] = {}
        # structured output: each such request's grammar state; the backend (the tokenizer's
        # vocabulary for xgrammar) is built when the first such request arrives. Both are made
        # on a thread beside the step loop (seconds for a large vocabulary or an intricate
        # schema, which would otherwise stall every running request): meanwhile the request
        # stays out of the scheduler's queue, in `_compiling` (`_admit_compiled`).
        self.grammars: dict[int, GrammarState] = {}
        self._grammar_backend: GrammarBackend | None = None
        self._grammar_thread: ThreadPoolExecutor | None = None
        self._compiling: dict[int, tuple[Request, Future]] = {}
        self._model_cfg = m  # (the grammar backend reads its tokenizer and vocabulary)
        self._batch = ScheduledBatch()
        self._step_record: StepRecord | None = None

    def rebind(self, topo, transport: Transport, balance) -> int:
        """After the job lost ranks (fault tolerance): dispatch through the rebuilt world's
        ``transport`` and ``balance``; reads no weights (returns 0)."""
        self.experts = RemoteExperts(transport, self.timeline, balance.balancer)
        return 0

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._compiling)

    @property
    def kv_releases(self) -> int:
        """Parked prompts' blocks freed so far (prefill side): an idle rank frees them too,
        and must then publish its counters."""
        return self.scheduler.kv_releases

    @property
    def only_transfers(self) -> bool:
        """Its only work waits on another thread: KV being read from a prefill instance
        (`Scheduler.only_transfers`) or grammars being compiled (the loop polls, not spins)."""
        s = self.scheduler
        if self._compiling and not (s.waiting or s.running):
            return True
        return s.only_transfers

    def stats(self) -> dict:
        s = self.scheduler
        local = self.experts if isinstance(self.experts, LocalExperts) else None
        return {
            "kv_blocks_used": self.blocks.num_used,
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_cache_bytes_per_token": self.kv_cache.bytes_per_token,
            "kv_cache_bytes": self.kv_cache.nbytes,
            "prefix_caching": self.blocks.enable_prefix_caching,
            **self._window_stats(),
            "running": len(s.running),
            "waiting": len(s.waiting) + len(self._compiling),
            "kv_pulling": len(s.pulling),
            "preemptions": s.num_preemptions,
            "prefix_cached_blocks": self.blocks.num_cached,
            "prefix_evictions": self.blocks.num_evictions,
            "attention_backend": self.model.attention_backend.name,
            "moe_backend": local.backend.name if local else None,  # None: on expert ranks
            "weight_bytes": self.model.weight_bytes + (local.weight_bytes if local else 0),
            # decode steps replayed from CUDA graphs, and the batch sizes captured ([]: eager)
            **graph_stats(self.graphs),
            # colocated: the local experts' calls replayed from their own graphs
            **graph_stats(local.graphs if local else None, "expert_"),
            # compiled pieces that fell back to eager, and why (enforce_eager=False)
            "compile_errors": (
                self.model.pieces.errors if isinstance(self.model.pieces, CompiledPieces) else {}
            ),
            **(self.kv_connector.stats() if self.kv_connector else {}),
        }

    def _window_stats(self) -> dict:
        """The sliding-window layers' KV group: blocks held now, at most, and in all."""
        w = self.window_blocks
        if w is None:
            return {}
        return {
            "kv_window_blocks_used": w.num_used,
            "kv_window_blocks_peak": w.peak_used,
            "kv_window_blocks_total": w.num_blocks - 1,
        }

    def add_request(self, spec: RequestSpec) -> RequestUpdate | None:
        """Queues a request; a request that cannot be admitted fails alone: its update
        (``"error"``) is returned to be sent at once."""
        try:
            req = self.scheduler.add(spec)
        except Exception as e:
            error = _fault(self.rank, spec.request_id, "admission", e)
            t = spec.arrival_time
            metrics = RequestMetrics(t, 0.0, 0.0, 0.0, 0.0, len(spec.prompt_token_ids), 0)
            return RequestUpdate(spec.request_id, [], "error", metrics, error=error)
        try:
            gen = make_generator(spec.params, spec.request_id, self.seed, self.device)
        except Exception as e:
            self._arrival_faults[spec.request_id] = _fault(self.rank, spec.request_id, "seed", e)
            gen = None
        self.generators[spec.request_id] = gen
        if spec.params.json_schema is not None and spec.request_id not in self._arrival_faults:
            # out of the queue until its grammar is compiled (`add` appended it last)
            waiting = self.scheduler.waiting
            if waiting and waiting[-1] is req:
                waiting.pop()
            else:
                waiting.remove(req)
            if self._grammar_thread is None:
                self._grammar_thread = ThreadPoolExecutor(
                    1, thread_name_prefix="grammar", initializer=_lower_priority
                )
            future = self._grammar_thread.submit(self._grammar_of, spec)
            self._compiling[spec.request_id] = (req, future)
        return None

    def _grammar_of(self, spec: RequestSpec) -> GrammarState:
        """(On the grammar thread: the backend and its cache are only touched there.) The
        request's grammar state, past the tokens it generated already (a resumed request)."""
        if self._grammar_backend is None:
            m = self._model_cfg
            # (one xgrammar thread on a CPU rank: its cores run the steps meanwhile)
            threads = 1 if self.device.type == "cpu" else None
            self._grammar_backend = GrammarBackend.from_checkpoint(
                m.path, m.vocab_size, tuple(m.eos_token_ids), compile_threads=threads
            )
        state = self._grammar_backend.state(spec.params.json_schema)
        for token in spec.output_token_ids:
            state.accept(token)
        return state

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready join the queue; one whose grammar failed joins it
        too and fails at its first sampling, alone (as any fault on arrival)."""
        for rid, (req, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            try:
                self.grammars[rid] = future.result()
            except Exception as e:
                self._arrival_faults[rid] = _fault(self.rank, rid, "grammar", e)
            self.scheduler.waiting.append(req)

    def abort(self, request_ids: list[int]) -> list[RequestUpdate]:
        """Drops these requests at once, blocks freed; an update (``"abort"``) for each that was
        still here."""
        updates = []
        for rid in request_ids:
            req = self.scheduler.abort(rid)
            if rid in self._compiling:  # (never scheduled: it holds no blocks)
                req, future = self._compiling.pop(rid)
                future.cancel()
            if req is not None:
                self.generators.pop(rid, None)
                self._arrival_faults.pop(rid, None)
                self.grammars.pop(rid, None)
                updates.append(RequestUpdate(rid, [], "abort", req.metrics()))
        return updates

    def plan(self) -> int:
        """Schedules this step; returns how many tokens it computes (0: only takes part)."""
        if self._compiling:
            self._admit_compiled()
        self._batch = self.scheduler.schedule()
        # (recorded here, before the sync, where a rank waits anyway: not between the sync and
        # the forward, which the expert ranks wait on)
        self._step_record = self._record(self._batch)
        return self._batch.total_tokens

    def _inputs(self, reqs: list, counts: list[int]) -> tuple[MicroBatch, list[int], list]:
        """Packs the tokens of ``reqs`` (``counts[i]`` new tokens each); returns the micro-batch,
        the rows whose last token gets sampled and their requests. (Plain lists, then one numpy
        array per field: at decode batch sizes the per-request loop is most of the cost.)"""
        bs = self.blocks.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seqlens: list[int] = []
        sample_rows: list[int] = []
        to_sample = []
        width = max((len(r.block_table) for r in reqs), default=0)
        tables: list[int] = []
        for req, n in zip(reqs, counts):
            start = req.num_computed_tokens
            end = start + n
            table = req.block_table
            if n == 1:  # a decode token (or a one-token prompt chunk)
                ids.append(req.token_at(start))
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids += req.token_ids(start, end)
                positions += range(start, end)
                slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            seqlens.append(end)
            if end == req.num_tokens:
                sample_rows.append(len(ids) - 1)
                to_sample.append(req)
            tables += table
            if len(table) < width:
                tables += [0] * (width - len(table))
        loc = [0]
        for n in counts:
            loc.append(loc[-1] + n)
        meta = AttentionMetadata(
            query_start_loc=self._tensor(loc, np.int64),
            seq_lens=self._tensor(seqlens, np.int64),
            block_tables=self._tensor(tables, np.int32).view(len(reqs), width),
            slot_mapping=self._tensor(slots, np.int64),
            query_lens=list(counts),
            seq_lens_list=seqlens,
        )
        mb = MicroBatch(
            input_ids=self._tensor(ids, np.int64),
            positions=self._tensor(positions, np.int64),
            meta=meta,
            window_meta=None if self.window_blocks is None else self._window_meta(reqs, meta),
        )
        return mb, sample_rows, to_sample

    def _window_meta(self, reqs: list, meta: AttentionMetadata) -> AttentionMetadata:
        """``meta`` with the sliding-window layers' block tables and slots (`window_blocks`):
        the same positions, other block ids (null where a block fell out of the window)."""
        bs = self.blocks.block_size
        width = max((len(r.window_table) for r in reqs), default=0)
        tables: list[int] = []
        slots: list[int] = []
        for req, n in zip(reqs, meta.query_lens):
            table = req.window_table
            start = req.num_computed_tokens
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            tables += table + [0] * (width - len(table))
        return AttentionMetadata(
            query_start_loc=meta.query_start_loc,
            seq_lens=meta.seq_lens,
            block_tables=self._tensor(tables, np.int32).view(len(reqs), width),
            slot_mapping=self._tensor(slots, np.int64),
            query_lens=meta.query_lens,
            seq_lens_list=meta.seq_lens_list,
        )

    def _tensor(self, values: list[int], dtype: type) -> torch.Tensor:
        """A list of ints as a 1-D tensor on this rank's device (via numpy, which converts a
        list faster than ``torch.tensor`` does)."""
        return torch.from_numpy(np.array(values, dtype=dtype)).to(self.device)

    def _record(self, batch: ScheduledBatch) -> StepRecord | None:
        if not batch.requests:
            return None
        return StepRecord(
            rank=self.rank,
            time=time.time(),
            num_seqs=len(batch),
            num_tokens=batch.total_tokens,
            num_decode=sum(
                1
                for r, n in zip(batch.requests, batch.num_new_tokens)
                if n == 1 and r.output_token_ids
            ),
            kv_blocks_used=self.blocks.num_used,
            kv_blocks_total=self.blocks.num_blocks,
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
        )

    @torch.inference_mode()
    def execute(self, micro_batches: int = 1) -> tuple[list[RequestUpdate], StepRecord | None]:
        """Runs the planned step as ``micro_batches`` micro-batches (every attention and expert
        rank uses the same count; with zero tokens a rank still joins every dispatch/combine);
        returns the requests' new tokens and a record of the step (None if it had no tokens)."""
        batch, record = self._batch, self._step_record
        parts = split_micro_batches(batch.num_new_tokens, micro_batches)
        rows, to_sample, scheduled = {}, {}, {}

        def build(j: int) -> MicroBatch:
            # micro-batch j's inputs, when the forward first needs them: those of j > 0 are
            # packed while the experts work on micro-batch 0
            with self.timeline.span("inputs", "compute"):
                reqs = [batch.requests[i] for i in parts[j]]
                counts = [batch.num_new_tokens[i] for i in parts[j]]
                scheduled[j] = list(zip(reqs, counts))
                mb, rows[j], to_sample[j] = self._inputs(reqs, counts)
                return mb

        updates: list[RequestUpdate] = []

        def done(j: int, h: torch.Tensor) -> None:
            # micro-batch j's final hidden states are ready: sample it while the experts work on
            # later micro-batches
            for req, n in scheduled[j]:
                self.scheduler.computed(req, n)
            if to_sample[j]:
                with self.timeline.span("sample", "compute"):
                    logits = self.model.logits(select_rows(h, rows[j]))
                    updates.extend(self._sample_logits(logits, to_sample[j]))

        graphed = None
        if self.graphs is not None and micro_batches == 1:
            graphed = self.graphs.segment(batch.num_new_tokens)
        with self.timeline.span(f"forward m={micro_batches}", "compute"):
            self.model.forward(
                Lazy(micro_batches, build), self.kv_cache, self.experts, done, graphed
            )
        return updates, record

    def _sample_logits(self, logits: torch.Tensor, to_sample: list) -> list[RequestUpdate]:
        """Next tokens of the requests whose prompt is done from their rows of ``logits``
        ``[B, V]``, appended to them, as the front end's updates.

        An exception while sampling or taking logprobs for some rows fails those requests alone
        (``finish_reason="error"``, blocks freed, traceback logged): the batch is redone row by
        row, and since `sample` draws from no generator before every row's logits are processed,
        every other row gets exactly the token it would have got."""
        faults: dict[int, str] = {}  # row -> error
        if self._arrival_faults:
            for i, req in enumerate(to_sample):
                if req.request_id in self._arrival_faults:
                    faults[i] = self._arrival_faults.pop(req.request_id)
        tokens = None
        if not faults:
            try:
                tokens = self._choose(logits, to_sample)
            except Exception:
                logger.debug("rank %d: sampling a batch raised; redone row by row", self.rank)
        if tokens is None:
            tokens = [0] * len(to_sample)
            for i, req in enumerate(to_sample):
                if i not in faults:
                    try:
                        tokens[i] = self._choose(logits[i : i + 1], [req])[0]
                    except Exception as e:
                        faults[i] = _fault(self.rank, req.request_id, "sampling", e)
        lps = None
        try:
            if any(r.params.logprobs is not None for r in to_sample):
                lps = token_logprobs(logits, tokens, [r.params for r in to_sample])
        except Exception:
            lps = [None] * len(to_sample)
            for i, req in enumerate(to_sample):
                if i not in faults:
                    try:
                        if req.params.logprobs is not None:
                            row = logits[i : i + 1]
                            lps[i] = token_logprobs(row, [tokens[i]], [req.params])[0]
                    except Exception as e:
                        faults[i] = _fault(self.rank, req.request_id, "logprobs", e)
        now = time.time()
        updates = []
        for i, (req, tok) in enumerate(zip(to_sample, tokens)):
            if i in faults:
                updates.append(self._fail(req, faults[i]))
                continue
            req.append_token(tok, now)
            grammar = self.grammars.get(req.request_id)
            if grammar is not None:
                try:
                    grammar.accept(tok)
                except Exception as e:
                    updates.append(self._fail(req, _fault(self.rank, req.request_id, "grammar", e)))
                    continue
                if grammar.terminated and req.finish_reason is None:
                    req.finish_reason = "stop"  # (the JSON is complete)
            update = RequestUpdate(req.spec.request_id, [tok])
            if lps is not None and lps[i] is not None:
                update.logprobs = [lps[i]]
            if req.finish_reason is not None:
                self.scheduler.finish(req)
                del self.generators[req.request_id]
                self.grammars.pop(req.request_id, None)
                update.finish_reason = req.finish_reason
                update.metrics = req.metrics()
            updates.append(update)
        return updates

    def _choose(self, logits: torch.Tensor, to_sample: list) -> list[int]:
        """Next tokens of ``to_sample`` from their rows of ``logits [B, V]`` (which stay as they
        are: logprobs are the model's)."""
        if self.grammars:
            states = [self.grammars.get(r.request_id) for r in to_sample]
            if any(st is not None for st in states):
                logits = logits.clone()
                apply_grammar_masks(logits, states)  # (-inf where the grammar forbids)
        return sample(
            logits,
            [r.params for r in to_sample],
            [self.generators[r.request_id] for r in to_sample],
            to_sample,
            self.scheduler.eos_token_ids,
        )

    def _fail(self, req, error: str) -> RequestUpdate:
        """Ends a request whose handling raised: its blocks are freed and its stream dropped."""
        self.scheduler.abort(req.request_id)
        req.finish_reason = "error"
        self.generators.pop(req.request_id, None)
        self.grammars.pop(req.request_id, None)
        return RequestUpdate(req.request_id, [], "error", req.metrics(), error=error)


def _lower_priority() -> None:
    """The calling thread yields its core to the step's threads (nice 10: Linux schedules
    threads alone). On a CPU rank a compile that takes a core from the step's thread pool
    stalls every barrier of the pool; the request waiting for the grammar can wait longer."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # (not Linux: the scheduler decides)
        pass


def _fault(rank: int, request_id: int, stage: str, error: Exception) -> str:
    """Logs a fault that fails one request alone (with its traceback); returns the request's
    error message."""
    logger.error(
        "rank %d: request %d failed in %s and is ended; the other requests go on",
        rank,
        request_id,
        stage,
        exc_info=error,
    )
    return request_error(stage, error)
