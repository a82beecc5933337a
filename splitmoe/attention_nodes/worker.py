"""The attention rank's step: schedule, build the packed batch, run the model, sample."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from splitmoe.attention_nodes.kv_cache import PagedKVCache
from splitmoe.attention_nodes.model import AttentionModel, MicroBatch
from splitmoe.attention_nodes.remote_decode import RemoteDecodeStep
from splitmoe.attention_nodes.sampler import make_generator, sample
from splitmoe.comm.transport import Transport
from splitmoe.config import EngineConfig
from splitmoe.expert_nodes.experts import LocalExperts
from splitmoe.kernels.cpu_native import DecodeInputs
from splitmoe.kernels.paged_attention import AttentionMetadata
from splitmoe.metrics import StepRecord
from splitmoe.models.loader import load_attention_weights
from splitmoe.outputs import RequestMetrics
from splitmoe.scheduler.balancer import Balancer
from splitmoe.scheduler.block_manager import BlockManager
from splitmoe.scheduler.request import RequestSpec
from splitmoe.scheduler.scheduler import ScheduledBatch, Scheduler
from splitmoe.timeline import Timeline


@dataclass
class RequestUpdate:
    """New tokens of one request from one step; ``metrics`` once it finished."""

    request_id: int
    new_token_ids: list[int]
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None


class RemoteExperts:
    """ExpertExecutor over a transport: `start` picks the replica of each (token, expert) with
    the balancer and dispatches by slot to the expert ranks, `finish` combines their partial
    sums."""

    def __init__(self, transport: Transport, timeline: Timeline, balancer: Balancer):
        self.transport = transport
        self.timeline = timeline
        self.balancer = balancer
        # the static balancer's fixed map and the dispatch in one native call, where they can
        self._static = getattr(transport, "dispatches_static", False)

    def start(self, layer, x, topk_ids, topk_weights):
        static = self._static and self.balancer.static_map(layer)
        if static:
            with self.timeline.span(f"dispatch L{layer}", "comm"):
                return self.transport.dispatch_static(x, topk_ids, topk_weights, *static, layer)
        with self.timeline.span(f"balance L{layer}", "compute"):
            slots = self.balancer.choose(layer, topk_ids)  # [T, k]
        with self.timeline.span(f"dispatch L{layer}", "comm"):
            return self.transport.dispatch(x, slots, topk_weights, layer=layer)

    def finish(self, handle):
        with self.timeline.span(f"combine L{handle.layer}", "wait"):
            return self.transport.combine(handle)


def split_micro_batches(num_tokens: list[int], m: int) -> list[list[int]]:
    """Indices of the requests in each of ``m`` micro-batches, balanced by token count (longest
    first onto the lightest micro-batch; ties to the lowest index), each in batch order. Some may
    be empty: every micro-batch still takes part in the collectives."""
    n = len(num_tokens)
    if n and min(num_tokens) == max(num_tokens):  # (decode steps) this is round robin
        return [list(range(j, n, m)) for j in range(m)]
    loads = [(0, j) for j in range(m)]  # a heap of (tokens, micro-batch)
    parts: list[list[int]] = [[] for _ in range(m)]
    # longest first; sorted's stability keeps equal lengths in index order
    for i in sorted(range(n), key=num_tokens.__getitem__, reverse=True):
        load, j = loads[0]
        heapq.heapreplace(loads, (load + num_tokens[i], j))
        parts[j].append(i)
    return [sorted(p) for p in parts]


def _select_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]`` for ascending ``rows``; ``t`` itself when they are all of its rows."""
    return t if len(rows) == t.shape[0] else t[rows]


class _Lazy(Sequence):
    """``build(j)`` for j < n, each built once, on first access."""

    def __init__(self, n: int, build: Callable[[int], object]):
        self._n, self._build, self._items = n, build, {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, j: int):
        if not 0 <= j < self._n:
            raise IndexError(j)
        if j not in self._items:
            self._items[j] = self._build(j)
        return self._items[j]


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
        self.model = AttentionModel(m, globals_, layers, device, cfg.backend("attention_backend"))
        self.experts = (
            LocalExperts(m, list(range(m.num_experts)), dtype, device, cfg.backend("moe_backend"))
            if transport is None
            else RemoteExperts(transport, self.timeline, balancer)
        )
        block_size = cfg.cache.block_size
        num_blocks = cfg.cache.resolve_num_blocks(
            m, dtype, cfg.scheduler.max_num_seqs, cfg.max_model_len
        )
        self.kv_cache = PagedKVCache(
            m.num_layers, num_blocks, block_size, m.num_kv_heads, m.head_dim, dtype, device
        )
        self.blocks = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(cfg.scheduler, self.blocks, m.eos_token_ids, cfg.max_model_len)
        if transport is None:  # colocated: where it can, a decode step is one native call
            self.model.fuse_experts(self.experts)
        # experts on ranks of this host: where it can, each decode (layer, micro-batch) is one
        # native call
        self.remote_decode = (
            None
            if transport is None
            else RemoteDecodeStep.build(
                self.model, self.kv_cache, transport, balancer, self.timeline
            )
        )
        self.generators: dict[int, torch.Generator | None] = {}
        self._batch = ScheduledBatch()
        self._step_record: StepRecord | None = None
        # a begun step: each micro-batch's requests and inputs (its layer 0 dispatched)
        self._begun: list[tuple[list, DecodeInputs]] | None = None
        self.steps_begun = 0  # steps begun by the one before (`execute` with ``begin_next``)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def stats(self) -> dict:
        if self.remote_decode is not None:  # (its steps' transport stats, before they are read)
            self.remote_decode.record()
        s = self.scheduler
        return {
            "kv_blocks_used": self.blocks.num_used,
            "kv_blocks_total": self.blocks.num_blocks,
            "running": len(s.running),
            "waiting": len(s.waiting),
            "preemptions": s.num_preemptions,
            "attention_backend": self.model.attention_backend,
            "moe_backend": getattr(self.experts, "backend", None),  # None: experts elsewhere
            "fused_decode_step": self.model.decode_step is not None,  # (colocated, native)
            # (experts on other ranks of this host, native: a call per layer and micro-batch)
            "remote_decode_step": self.remote_decode is not None,
            "steps_begun": self.steps_begun,
        }

    def add_request(self, spec: RequestSpec) -> None:
        self.scheduler.add(spec)
        self.generators[spec.request_id] = make_generator(
            spec.params, spec.request_id, self.seed, self.device
        )

    def plan(self) -> int:
        """Schedules this step; returns how many tokens it computes (0: only takes part). A step
        that the last one began (`execute` with ``begin_next``) is planned as it was begun: its
        requests, a token each, in its micro-batches; waiting requests wait for the next."""
        if self._begun is not None:
            reqs = [req for part, _ in self._begun for req in part]
            self._batch = ScheduledBatch(reqs, [1] * len(reqs))
        else:
            self._batch = self.scheduler.schedule()
        # (recorded here, before the sync, where a rank waits anyway: not between the sync and
        # the forward, which the expert ranks wait on)
        self._step_record = self._record(self._batch)
        return self._batch.total_tokens

    def can_begin_next(self) -> bool:
        """Whether the planned step can begin the next one as its micro-batches are sampled:
        a native remote decode step of every running request (each sampled), no request
        waiting to be admitted (the next step is then this one's requests again, less those
        that finish) and a free KV block for each request whose next token needs one (so the
        next step preempts no one)."""
        batch, s = self._batch, self.scheduler
        if self.remote_decode is None or s.waiting or len(batch) != len(s.running):
            return False
        blocks, need = self.blocks, 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if n != 1 or req.num_computed_tokens + 1 != req.num_tokens:
                return False
            need += blocks.blocks_for(req.num_tokens + 1) > len(req.block_table)
        return need <= blocks.num_free

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
        )
        return mb, sample_rows, to_sample

    def _decode_inputs(self, reqs: list) -> tuple[DecodeInputs, list[int], list]:
        """`_inputs` for a micro-batch of one token per request, as `RemoteDecodeStep` takes it
        (the lengths, slots and RoPE rows are derived natively: the fewer Python and torch
        calls between the native ones, the less the attention rank, which sets the pipeline's
        pace, spends on them)."""
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        to_sample = []
        width = max((len(r.block_table) for r in reqs), default=0)
        tables: list[int] = []
        for i, req in enumerate(reqs):
            start = req.num_computed_tokens
            ids.append(req.token_at(start))
            positions.append(start)
            if start + 1 == req.num_tokens:
                sample_rows.append(i)
                to_sample.append(req)
            table = req.block_table
            tables += table
            if len(table) < width:
                tables += [0] * (width - len(table))
        inputs = DecodeInputs(
            np.array(ids, dtype=np.int64),
            np.array(positions, dtype=np.int64),
            np.array(tables, dtype=np.int32).reshape(len(reqs), width),
        )
        return inputs, sample_rows, to_sample

    def _tensor(self, values: list[int], dtype: type) -> torch.Tensor:
        """A list of ints as a 1-D tensor on this rank's device (via numpy: ~3x faster than
        ``torch.tensor`` on a list)."""
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
    def execute(
        self, micro_batches: int = 1, begin_next: bool = False
    ) -> tuple[list[RequestUpdate], StepRecord | None]:
        """Runs the planned step as ``micro_batches`` micro-batches (every attention and expert
        rank uses the same count; with zero tokens a rank still joins every dispatch/combine);
        returns the requests' new tokens and a record of the step (None if it had no tokens).

        ``begin_next`` (every rank agreed, on a step `can_begin_next` allowed): as soon as a
        micro-batch is sampled, its requests that go on begin the next step, as the same
        micro-batch: their KV blocks, their inputs and layer 0 up to its dispatch; `plan` then
        plans that step as begun."""
        batch, begun, record = self._batch, self._begun, self._step_record
        if self.model.decode_step is not None and max(batch.num_new_tokens, default=0) == 1:
            return self._decode_step(batch), record  # (colocated: micro-batches overlap nothing)
        rows, to_sample, scheduled = {}, {}, {}
        if begun is not None:  # (its inputs went out with layer 0: only the bookkeeping)
            self._begun = None
            self.steps_begun += 1
            if len(begun) != micro_batches:
                raise RuntimeError(
                    f"rank {self.rank}: a step begun as {len(begun)} micro-batches was run as "
                    f"{micro_batches}: the ranks' step decisions diverged"
                )
            for j, (reqs, _) in enumerate(begun):
                scheduled[j] = [(req, 1) for req in reqs]
                rows[j], to_sample[j] = list(range(len(reqs))), reqs
        else:
            parts = split_micro_batches(batch.num_new_tokens, micro_batches)

        # (a rank with no tokens joins a decode step's calls natively too)
        remote = self.remote_decode is not None and max(batch.num_new_tokens, default=1) == 1
        if (begun is not None or begin_next) and not remote:
            raise RuntimeError(
                f"rank {self.rank}: only native remote decode steps begin the next one"
            )

        def build(j: int) -> MicroBatch | DecodeInputs:
            # micro-batch j's inputs, when the forward first needs them: those of j > 0 are
            # packed while the experts work on micro-batch 0
            with self.timeline.span("inputs", "compute"):
                reqs = [batch.requests[i] for i in parts[j]]
                counts = [batch.num_new_tokens[i] for i in parts[j]]
                scheduled[j] = list(zip(reqs, counts))
                if remote:
                    inputs, rows[j], to_sample[j] = self._decode_inputs(reqs)
                    return inputs
                mb, rows[j], to_sample[j] = self._inputs(reqs, counts)
                return mb

        mbs = _Lazy(micro_batches, build)  # (a begun step builds none)
        updates: list[RequestUpdate] = []
        following: list[tuple[list, DecodeInputs]] = []
        chosen: dict[int, list[int]] = {}  # micro-batch j's tokens, where `begin` chose them

        def done(j: int, out: torch.Tensor, logits: bool = False) -> None:
            # micro-batch j's final hidden states (or logits) are ready: sample it while the
            # experts work on later micro-batches
            for req, n in scheduled[j]:
                req.num_computed_tokens += n
            if to_sample[j]:
                with self.timeline.span("sample", "compute"):
                    out = _select_rows(out, rows[j])
                    updates.extend(
                        self._sample_logits(
                            out if logits else self.model.logits(out), to_sample[j], chosen.get(j)
                        )
                    )

        def begin(j: int, logits: torch.Tensor) -> DecodeInputs:
            # micro-batch j's tokens and the next step's micro-batch j from them, first thing:
            # the expert ranks wait for it; the bookkeeping (`done`) follows its dispatch
            with self.timeline.span("begin next", "compute"):
                reqs = to_sample[j]  # (every request of it: `can_begin_next`)
                chosen[j] = self._choose(_select_rows(logits, rows[j]), reqs)
                prev = mbs[j] if begun is None else begun[j][1]
                following.append(self._begin(reqs, prev, chosen[j]))
                return following[-1][1]

        with self.timeline.span(f"forward m={micro_batches}", "compute"):
            if remote:
                self.remote_decode.run(
                    None if begun is not None else mbs,
                    lambda j, logits: done(j, logits, logits=True),
                    begin if begin_next else None,
                )
            else:
                self.model.forward(mbs, self.kv_cache, self.experts, on_done=done)
        if begin_next:
            self._begun = following
        return updates, record

    def _begin(
        self, reqs: list, inputs: DecodeInputs, tokens: list[int]
    ) -> tuple[list, DecodeInputs]:
        """The next step's micro-batch after that of ``reqs`` (with ``inputs``), whose next
        ``tokens`` are chosen but not yet appended: the requests they do not finish, and their
        inputs, each a token further (that token, one position on, in a new block where it
        starts one). Derived from ``inputs`` in a few numpy ops rather than `_decode_inputs`'
        loop over the requests: the expert ranks wait for this."""
        keep = [i for i, (req, tok) in enumerate(zip(reqs, tokens)) if not req.finishes_with(tok)]
        going = [reqs[i] for i in keep]
        positions = inputs.positions[keep] + 1  # [T']
        tables = inputs.block_tables[keep]  # [T', width] (a copy)
        bs = self.blocks.block_size
        for t in np.flatnonzero(positions % bs == 0).tolist():  # its token starts a block
            req, col = going[t], int(positions[t]) // bs
            if not self.blocks.grow(req.block_table, req.num_tokens + 1):
                raise RuntimeError(  # (`can_begin_next` counted the blocks)
                    f"rank {self.rank}: no KV block for request {req.request_id}'s next token "
                    f"in a begun step"
                )
            if col >= tables.shape[1]:
                tables = np.pad(tables, ((0, 0), (0, col + 1 - tables.shape[1])))
            tables[t, col] = req.block_table[col]
        ids = np.array(tokens, dtype=np.int64)[keep]
        return going, DecodeInputs(ids, positions, tables)

    def _decode_step(self, batch: ScheduledBatch) -> list[RequestUpdate]:
        """A step of one-token sequences through the model's `decode_step` (one native call)."""
        with self.timeline.span("inputs", "compute"):
            mb, rows, to_sample = self._inputs(batch.requests, batch.num_new_tokens)
        with self.timeline.span("forward m=1", "compute"):
            logits = self.model.decode_logits(mb, self.kv_cache)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
        if not to_sample:
            return []
        with self.timeline.span("sample", "compute"):
            return self._sample_logits(_select_rows(logits, rows), to_sample)

    def _choose(self, logits: torch.Tensor, to_sample: list) -> list[int]:
        """Next tokens of ``to_sample`` from their rows of ``logits [B, V]``."""
        return sample(
            logits,
            [r.params for r in to_sample],
            [self.generators[r.request_id] for r in to_sample],
        )

    def _sample_logits(
        self, logits: torch.Tensor, to_sample: list, tokens: list[int] | None = None
    ) -> list[RequestUpdate]:
        """Next tokens of the requests whose prompt is done from their rows of ``logits``
        ``[B, V]`` (or ``tokens``, chosen from them already), appended to them, as the front
        end's updates."""
        if tokens is None:
            tokens = self._choose(logits, to_sample)
        now = time.time()
        updates = []
        for req, tok in zip(to_sample, tokens):
            req.append_token(tok, now)
            update = RequestUpdate(req.spec.request_id, [tok])
            if req.finish_reason is not None:
                self.scheduler.finish(req)
                del self.generators[req.request_id]
                update.finish_reason = req.finish_reason
                update.metrics = req.metrics()
            updates.append(update)
        return updates
