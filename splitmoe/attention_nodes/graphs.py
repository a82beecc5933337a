"""CUDA graphs for decode steps on an attention rank: one graph per layer segment and batch-size
bucket, the communication between them.

A decode step at small batch is bound by launches and per-layer Python on a GPU; vLLM and SGLang
replay a captured graph instead. Here the unit captured is `AttentionModel.layer_segment`: all of
a layer that involves no other rank (residual, norms, QKV, RoPE, the paged-attention store and
kernel, output projection, dense MLP or router). Between two segments the forward runs eagerly
what crosses ranks (`ExpertExecutor.start` / `finish`: dispatch, combine, local experts), as
vLLM's piecewise graphs leave attention outside; so any transport works, graph-safe or not.
(Local experts replay graphs of their own: `splitmoe.expert_nodes.graphs`.)

* Buckets (`capture_sizes`): 1, 2, 4, then every multiple of 8 up to ``max_num_seqs`` (at most
  512). A step of ``T`` decode tokens replays the smallest bucket ``>= T`` (`bucket_for`);
  prefill and mixed steps, steps of several micro-batches and larger batches run eagerly.
* Static inputs per bucket: the hidden states entering layer 0, cos / sin, each layer's MoE
  output, and the attention metadata (one set for the full-attention layers, one for the
  sliding-window layers). Segment ``i + 1`` reads segment ``i``'s output tensor itself, so the
  residual stream is never copied between layers.
* Padding (`pad_rows`, `pad_meta`): the rows past ``T`` repeat the last real row (its token,
  position, cache slot, sequence length and block table), so they compute that row's values
  and store them into that row's slot: no slot of another request is written, and no sentinel
  slot is needed. The forward sees only the ``T`` real rows (views of the static outputs).
* Capture (`DecodeGraphs.capture`): at start-up, before any request, every bucket from the
  largest down, all segments in one memory pool, after two warm-up runs on a side stream (which
  also compile `torch.compile`'d pieces and run the Triton autotuners). The warm-ups store into
  slot 0 of every layer's cache, which no request holds yet. The decode kernel's split count is
  chosen for ``max_model_len`` tokens; it reads the real lengths from the device.
* Failure: a capture that raises logs one warning and leaves the rank eager.

On CPU (or with ``enforce_eager=True``) `DecodeGraphs.create` returns None: a no-op. The same
static-buffer plumbing runs on CPU with `RerunSegment` in place of a CUDA graph (it runs the
segment again on the static inputs and copies into the captured outputs), which is how the
tests check padding, chaining and unpadding against the eager forward without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from splitmoe.cuda_graphs import CudaGraphSegment, bucket_for, capture_sizes, captured, pad_rows
from splitmoe.kernels.attention_metadata import AttentionMetadata


@dataclass
class StaticMeta:
    """`AttentionMetadata` of a decode bucket of ``rows`` one-token sequences, in tensors whose
    storage a graph captured (``query_start_loc`` is fixed: sequence i owns row i)."""

    meta: AttentionMetadata

    @classmethod
    def alloc(cls, rows: int, width: int, max_model_len: int, device) -> StaticMeta:
        """``width``: block-table entries per sequence (``max_model_len`` / block size, up)."""
        return cls(
            AttentionMetadata(
                query_start_loc=torch.arange(rows + 1, dtype=torch.int64, device=device),
                seq_lens=torch.ones(rows, dtype=torch.int64, device=device),
                block_tables=torch.zeros(rows, width, dtype=torch.int32, device=device),
                slot_mapping=torch.zeros(rows, dtype=torch.int64, device=device),
                query_lens=[1] * rows,
                # host-side choices (the decode kernel's splits) for the longest context
                seq_lens_list=[max_model_len] * rows,
            )
        )

    def load(self, meta: AttentionMetadata) -> None:
        """Copies a decode step's ``meta`` (``T`` <= rows sequences of one token) in, padded
        (`pad_meta`)."""
        pad_meta(meta, self.meta)


def pad_meta(meta: AttentionMetadata, out: AttentionMetadata) -> None:
    """Writes the decode metadata ``meta`` of ``T`` one-token sequences into ``out``'s tensors
    (``R >= T`` sequences, block tables at least as wide), the sequences past ``T`` repeating
    the last one (its length, block table and slot)."""
    T, R = meta.num_seqs, out.num_seqs
    width = meta.block_tables.shape[1]
    if T > R or width > out.block_tables.shape[1] or any(n != 1 for n in meta.query_lens):
        raise ValueError(
            f"pad_meta: a decode step of {T} sequences and block tables of width {width} does "
            f"not fit a bucket of {R} sequences of width {out.block_tables.shape[1]}"
        )
    pad_rows(meta.seq_lens, R, out.seq_lens)
    pad_rows(meta.slot_mapping, R, out.slot_mapping)
    pad_rows(meta.block_tables, R, out.block_tables[:, :width])
    out.derived.clear()


@dataclass
class _Bucket:
    rows: int
    h: torch.Tensor  # [R, H]: layer 0's input
    cos: torch.Tensor  # [R, 1, rd]
    sin: torch.Tensor
    moe: list[torch.Tensor | None]  # [R, H] per layer: the previous layer's MoE output
    metas: dict[bool, StaticMeta]  # by "is a sliding-window layer"
    segments: list  # per layer, a CudaGraphSegment or RerunSegment


class DecodeGraphs:
    """The captured decode segments of one attention rank's model, every bucket; `segment`
    gives `AttentionModel.forward` the callable that replays them for a step."""

    def __init__(
        self,
        model,
        kv_cache,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        segment_cls: type = CudaGraphSegment,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = capture_sizes(max_num_seqs)
        self.width = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.segment_cls = segment_cls
        self.buckets: dict[int, _Bucket] = {}
        self.replays = 0  # steps run from the graphs (`stats`)

    @classmethod
    def create(
        cls,
        model,
        kv_cache,
        device: torch.device,
        enabled: bool,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        segment_cls: type = CudaGraphSegment,
    ) -> DecodeGraphs | None:
        """The captured graphs on a CUDA rank with ``enabled`` (not ``enforce_eager``); None
        elsewhere (CPU: a no-op) or when capturing failed (one warning; eager from then).
        ``segment_cls``: what captures a segment (`RerunSegment` runs anywhere: tests)."""
        if not enabled or (segment_cls is CudaGraphSegment and device.type != "cuda"):
            return None
        graphs = cls(model, kv_cache, max_num_seqs, max_model_len, block_size, segment_cls)
        return captured(graphs, "", "decoding eagerly")

    def capture(self) -> None:
        """Warms up and captures every bucket, largest first (smaller ones reuse its memory)."""
        m = self.model
        dev, dtype = m.embed.device, m.embed.dtype
        pool = torch.cuda.graph_pool_handle() if self.segment_cls is CudaGraphSegment else None
        for rows in reversed(self.sizes):
            H = m.embed.shape[1]
            cos, sin = m.rope(torch.zeros(rows, dtype=torch.int64, device=dev), dtype)
            b = _Bucket(
                rows=rows,
                h=torch.zeros(rows, H, dtype=dtype, device=dev),
                cos=cos.clone(),
                sin=sin.clone(),
                moe=[
                    None
                    if i == 0 or m.layers[i - 1].router is None
                    else torch.zeros(rows, H, dtype=dtype, device=dev)
                    for i in range(len(m.layers))
                ],  # fmt: skip
                metas={
                    w: StaticMeta.alloc(rows, self.width, self.max_model_len, dev)
                    for w in (False, True)
                },
                segments=[],
            )
            self.segment_cls.warm_up(partial(self._run_all, b))
            h = b.h
            for i in range(len(m.layers)):
                seg = self.segment_cls(self._segment_fn(b, i, h), pool)
                b.segments.append(seg)
                h = seg.outputs[0]
            self.buckets[rows] = b

    def _segment_fn(self, b: _Bucket, i: int, h: torch.Tensor) -> Callable[[], tuple]:
        m = self.model
        meta = b.metas[m.layers[i].window is not None].meta
        kv = self.kv_cache.layer(i)
        return lambda: m.layer_segment(i, h, b.moe[i], (b.cos, b.sin), kv, meta)

    def _run_all(self, b: _Bucket) -> None:
        h = b.h
        for i in range(len(self.model.layers)):
            h = self._segment_fn(b, i, h)()[0]

    def segment(self, query_lens: list[int]) -> Callable | None:
        """The callable standing for `AttentionModel.layer_segment` (``segment=`` of
        `AttentionModel.forward`) in a step of one micro-batch whose sequences take
        ``query_lens`` new tokens each: it replays the bucket's graphs. None where the step
        runs eagerly: not pure decode, or more sequences than the largest bucket."""
        rows = bucket_for(len(query_lens), self.sizes)
        if rows is None or any(n != 1 for n in query_lens):
            return None
        return _Replay(self, self.buckets[rows], len(query_lens))


class _Replay:
    """One step's replay of a bucket: pads the inputs in, replays segment by segment, hands
    back views of the ``T`` real rows."""

    def __init__(self, graphs: DecodeGraphs, bucket: _Bucket, num_tokens: int):
        self.graphs, self.b, self.T = graphs, bucket, num_tokens
        self.loaded: set[int] = set()  # ids of the metadata objects copied in this step

    def __call__(self, i, h, moe_out, cos_sin, kv, meta):
        b, T = self.b, self.T
        layers = self.graphs.model.layers
        if i == 0:
            pad_rows(h, b.rows, b.h)
            pad_rows(cos_sin[0], b.rows, b.cos)
            pad_rows(cos_sin[1], b.rows, b.sin)
            self.graphs.replays += 1
        elif h.data_ptr() != b.segments[i - 1].outputs[0].data_ptr():
            raise RuntimeError("a graphed step's residual stream left the graph's buffers")
        if id(meta) not in self.loaded:
            b.metas[layers[i].window is not None].load(meta)
            self.loaded.add(id(meta))
        if b.moe[i] is not None:
            pad_rows(moe_out, b.rows, b.moe[i])
        seg = b.segments[i]
        seg.replay()
        h_out, x, routing = seg.outputs
        if routing is not None:
            routing = (routing[0][:T], routing[1][:T])
        return h_out[:T], None if x is None else x[:T], routing
