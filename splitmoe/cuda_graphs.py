"""What CUDA graphs of decode need on every rank that captures them: the batch-size buckets
(`capture_sizes`, `bucket_for`), padding into static buffers (`pad_rows`), and the captured unit
(`CudaGraphSegment`, or `RerunSegment`, its contract without a GPU, for tests on CPU).

Attention ranks capture their layer segments (`splitmoe.attention_nodes.graphs`), expert ranks
and colocated attention ranks their experts' FFN per layer (`splitmoe.expert_nodes.graphs`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger("splitmoe")

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch-size buckets captured for ``max_num_seqs`` running requests, ascending:
    1, 2, 4, then multiples of 8 (vLLM's list), up to ``max_num_seqs`` rounded up to a
    bucket, at most `MAX_CAPTURE_SIZE`."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4] + list(range(8, MAX_CAPTURE_SIZE + 1, 8))
    return [s for s in sizes if s < top] + [next(s for s in sizes if s >= top)]


def bucket_for(num_tokens: int, sizes: list[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) holding ``num_tokens``; None for 0 tokens or more
    than the largest (run eagerly)."""
    if num_tokens < 1:
        return None
    for s in sizes:
        if s >= num_tokens:
            return s
    return None


def pad_rows(t: torch.Tensor, rows: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``t [T, ...]`` with ``rows - T`` copies of its last row appended (``rows >= T >= 1``),
    written into ``out`` (``[rows, ...]``) when given."""
    T = t.shape[0]
    if not 1 <= T <= rows:
        raise ValueError(f"pad_rows: {T} rows cannot be padded to {rows}")
    if out is None:
        out = t.new_empty((rows, *t.shape[1:]))
    out[:T].copy_(t)
    out[T:].copy_(t[T - 1 :].expand(rows - T, *t.shape[1:]))
    return out


class CudaGraphSegment:
    """``fn()`` captured in a CUDA graph (in ``pool``); `replay` reruns it, its outputs in
    `outputs`."""

    def __init__(self, fn: Callable[[], object], pool):
        self.graph = torch.cuda.CUDAGraph()
        # thread-local: a transport's thread may touch CUDA while the rank captures
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.outputs = fn()

    @staticmethod
    def warm_up(fn: Callable[[], object], times: int = 2) -> None:
        """Runs ``fn`` before its capture, on a side stream (lazy initialisations, compiles,
        autotuners and first-call kernel choices then happen outside the graph)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(times):
                fn()
        torch.cuda.current_stream().wait_stream(stream)

    def replay(self) -> None:
        self.graph.replay()


class RerunSegment:
    """`CudaGraphSegment`'s contract without a GPU: ``fn()`` run once for its outputs, `replay`
    runs it again on the same static inputs and copies into those outputs. (Used on CPU to test
    the static-buffer plumbing: buckets, padding, chaining, unpadding.) ``fn``'s outputs:
    tensors, None, or tuples of them."""

    def __init__(self, fn: Callable[[], object], pool=None):
        self.fn = fn
        self.outputs = fn()

    @staticmethod
    def warm_up(fn: Callable[[], object], times: int = 2) -> None:
        """Nothing to warm up: the segment runs ``fn`` itself at every replay."""

    def replay(self) -> None:
        for have, new in zip(_tensors(self.outputs), _tensors(self.fn())):
            have.copy_(new)


def captured(graphs, what: str, otherwise: str):
    """``graphs`` after its ``capture()``; None where capturing raised (a kernel that syncs
    with the host, out of memory, ...), with one warning naming ``what`` failed and what runs
    ``otherwise``: the rank stays eager from then on."""
    try:
        graphs.capture()
    except Exception as e:
        logger.warning(
            "CUDA graph capture%s failed (%s: %s); %s", what, type(e).__name__, e, otherwise
        )
        return None
    return graphs


def graph_stats(graphs, prefix: str = "") -> dict:
    """``llm.stats()`` keys of ``graphs`` (None: eager): the calls replayed and the bucket
    sizes captured."""
    return {
        f"{prefix}cuda_graph_steps": graphs.replays if graphs else 0,
        f"{prefix}cuda_graph_sizes": sorted(graphs.buckets) if graphs else [],
    }


def _tensors(out) -> list[torch.Tensor]:
    """The tensors in ``out`` (a tensor, None, or tuples of them), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, tuple | list):
        return [t for o in out for t in _tensors(o)]
    return []
