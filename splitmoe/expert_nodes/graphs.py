"""CUDA graphs of the routed experts' FFN: one graph per MoE layer and row-count bucket, on expert
ranks and on colocated attention ranks.

At decode sizes an expert rank's step is a handful of small kernels per layer and micro-batch
(the sort by expert, the two grouped GEMMs, the weighted sum), each paid for in launches and
Python on the host; replaying a captured graph pays one launch. The unit captured is
`LocalExperts.compute_eager` of one layer on static inputs: it involves no other rank, so the
transports stay outside, unchanged, and so do prefill-sized calls (more rows than the largest
bucket run eagerly).

* Buckets: `capture_sizes` of the most rows a call can hold at decode (``max_num_seqs`` per
  attention rank feeding this one: each sends at most one row per token). A call of ``N`` rows
  replays the smallest bucket ``>= N``, whatever the step (decode, a small prefill chunk, one
  micro-batch of several): unlike attention, every row's expert sum is its own.
* Padding: rows past ``N`` get expert id -1 (served elsewhere) in every slot, so the kernels
  skip them: no expert computes a padded row. Their hidden states and weights are left as the
  last call wrote them (never read).
* Memory: a bucket's static inputs and output (``[R, H]``, allocated before capture) are
  shared by its layers' graphs, and everything a graph allocates while captured is scratch,
  dead when it ends, so all graphs share one pool and replay in any order: the held memory does
  not grow with the layer count (DeepSeek-V3's 58 MoE layers would otherwise hold 58 outputs
  per bucket). The output is copied out at each replay (`replay`): a rank's partial sums leave
  asynchronously (`Transport.send_back`) while the next call may replay into the same buffer.
* Weights: a graph reads the layer's weight tensors it captured. Rebalances copy new experts
  into those tensors in place (`LocalExperts.apply`); a layer whose tensors were replaced
  anyway runs eagerly from then on (`replay` compares their addresses), never stale weights.
* Capture (`ExpertGraphs.create`): at start-up, every bucket from the largest down, every layer,
  one memory pool, after two warm-ups on a side stream (which also run the MoE backend's own
  first-call choices). A capture that raises logs one warning and leaves the rank eager.

On CPU (or with ``enforce_eager=True``) nothing is captured; `RerunSegment` stands in for a
CUDA graph in the tests of the padding and the buffers on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitmoe.cuda_graphs import CudaGraphSegment, bucket_for, capture_sizes, captured
from splitmoe.kernels.quant import QuantizedWeight

logger = logging.getLogger("splitmoe")


@dataclass
class _Bucket:
    rows: int
    x: torch.Tensor  # [R, H] hidden states
    ids: torch.Tensor  # [R, k] int32 local expert ids (-1: not here)
    weights: torch.Tensor  # [R, k] float32 router weights
    out: torch.Tensor  # [R, H] the sums, written by every layer's graph
    segments: dict  # per MoE layer: a CudaGraphSegment or RerunSegment


class ExpertGraphs:
    """The captured expert FFNs of one rank's experts (`LocalExperts`), every layer and bucket.

    ``compute``: ``(layer, x [N, H], local_ids [N, k], weights [N, k]) -> [N, H]``, the eager
    kernels; ``weights``: the live per-layer weight tuples it reads (``LocalExperts.weights``);
    ``slots``: local expert slots per MoE layer; ``max_rows``: the most rows one call takes at
    decode; ``top_k``: expert slots per row.

    The static ids are int32 and the static weights float32, whatever a call brings (int32 and
    float32 from a transport; int64 and the model's dtype from the router, colocated): both hold
    those values exactly, and the kernels widen router weights to float32 (Triton) or round them
    to the activations' dtype (``torch._grouped_mm``) either way, so the sums are eager's.
    """

    def __init__(
        self,
        compute: Callable[..., torch.Tensor],
        weights: dict[int, tuple],
        slots: dict[int, int],
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        max_rows: int,
        top_k: int,
        segment_cls: type = CudaGraphSegment,
    ):
        self.compute = compute
        self.weights = weights
        self.slots = dict(slots)
        self.hidden, self.dtype, self.device = hidden, dtype, device
        self.sizes = capture_sizes(max_rows)
        self.top_k = top_k
        self.segment_cls = segment_cls
        self.buckets: dict[int, _Bucket] = {}
        self.captured_weights: dict[int, tuple[int, ...]] = {}  # layer -> weight addresses
        self.replays = 0  # calls run from the graphs (`stats`)

    @classmethod
    def create(cls, *args, enabled: bool, **kwargs) -> ExpertGraphs | None:
        """`ExpertGraphs` (same arguments), captured, on a CUDA device with ``enabled`` (not
        ``enforce_eager``); None elsewhere (CPU: a no-op) or when capturing failed (one
        warning; eager from then)."""
        graphs = cls(*args, **kwargs)
        if not enabled or (graphs.segment_cls is CudaGraphSegment and graphs.device.type != "cuda"):
            return None
        return captured(graphs, " of the experts", "running them eagerly")

    def capture(self) -> None:
        """Warms up and captures every bucket, largest first (smaller ones reuse its memory)."""
        pool = torch.cuda.graph_pool_handle() if self.segment_cls is CudaGraphSegment else None
        gen = torch.Generator().manual_seed(0)
        for rows in reversed(self.sizes):
            x = torch.randn(rows, self.hidden, generator=gen)
            b = _Bucket(
                rows=rows,
                x=x.to(self.device, self.dtype),
                ids=torch.zeros(rows, self.top_k, dtype=torch.int32, device=self.device),
                weights=torch.full((rows, self.top_k), 1.0 / self.top_k, device=self.device),
                out=torch.zeros(rows, self.hidden, dtype=self.dtype, device=self.device),
                segments={},
            )
            for layer, n in self.slots.items():
                # the warm-ups touch the layer's experts: row r, slot j -> local slot r + j
                b.ids.copy_((torch.arange(rows)[:, None] + torch.arange(self.top_k)) % n)
                self.segment_cls.warm_up(self._fn(b, layer))
                b.segments[layer] = self.segment_cls(self._fn(b, layer), pool)
            self.buckets[rows] = b
        self.captured_weights = {layer: self._addresses(layer) for layer in self.slots}

    def _fn(self, b: _Bucket, layer: int) -> Callable[[], torch.Tensor]:
        return lambda: b.out.copy_(self.compute(layer, b.x, b.ids, b.weights))

    def _addresses(self, layer: int) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in _tensors(self.weights[layer]))

    def replay(
        self, layer: int, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor | None:
        """``compute``'s result for this call, replayed from the bucket at or
        above its rows (a tensor of its own); None where the call runs eagerly: no rows, more
        than the largest bucket, or the layer's weights no longer the captured tensors."""
        N = x.shape[0]
        rows = bucket_for(N, self.sizes)
        if rows is None or layer not in self.captured_weights:
            return None
        if self._addresses(layer) != self.captured_weights[layer]:
            logger.warning("layer %d's expert weights were replaced; running it eagerly", layer)
            del self.captured_weights[layer]
            return None
        b = self.buckets[rows]
        b.x[:N].copy_(x)
        b.ids[:N].copy_(local_ids)
        b.ids[N:].fill_(-1)
        b.weights[:N].copy_(weights)
        b.segments[layer].replay()
        self.replays += 1
        return b.out[:N].clone()


def _tensors(held) -> list[torch.Tensor]:
    """The plain tensors behind a layer's weights (a quantized weight's data and scales)."""
    out = []
    for t in held:
        out.extend((t.data, t.scale) if isinstance(t, QuantizedWeight) else (t,))
    return out
