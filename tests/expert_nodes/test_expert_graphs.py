"""CUDA graphs of the routed experts (`splitmoe.expert_nodes.graphs`), what runs without a GPU:
the buckets and padding replayed with `RerunSegment` against the eager kernels, calls that stay
eager, replaced weights, the no-op on CPU and the fallback when capture fails. On a GPU,
`test_cuda_graphs_match_eager_on_a_gpu` captures for real (run by `scripts/gpu_check.sh`)."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import make_tiny_checkpoint

from splitmoe.cuda_graphs import RerunSegment
from splitmoe.expert_nodes.experts import LocalExperts
from splitmoe.expert_nodes.graphs import ExpertGraphs
from splitmoe.kernels.backends import moe_backend
from splitmoe.models.config import ModelConfig

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 3-layer Qwen3-MoE with a dense layer 0 (MoE layers 1 and 2), 8 experts, top-2."""
    return make_tiny_checkpoint(
        "qwen3_moe", tmp_path_factory.mktemp("expert_graphs"), num_layers=3, mlp_only_layers=[0]
    )


def _experts(ckpt, device=CPU, ids=None) -> LocalExperts:
    """The experts ``ids`` (default: all) of every MoE layer, float32, the backend of the
    device (CPU: the grouped CPU kernels; CUDA: Triton)."""
    cfg = ModelConfig.from_hf(ckpt)
    ids = list(range(cfg.num_experts)) if ids is None else ids
    return LocalExperts(cfg, ids, torch.float32, device, moe_backend("auto", device))


def _graphs(ex: LocalExperts, max_rows: int, segment_cls=RerunSegment) -> ExpertGraphs | None:
    return ExpertGraphs.create(
        ex.compute_eager,
        ex.weights,
        {layer: len(ids) for layer, ids in ex.layer_experts.items()},
        ex.cfg.hidden_size,
        ex.dtype,
        ex.device,
        max_rows,
        ex.cfg.top_k,
        enabled=True,
        segment_cls=segment_cls,
    )


def _call(n: int, num_local: int, seed: int, device=CPU):
    """``n`` rows routed to two slots each, some of them served elsewhere (-1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 64, generator=g)
    ids = torch.randint(-1, num_local, (n, 2), generator=g, dtype=torch.int32)
    w = torch.rand(n, 2, generator=g)
    return x.to(device), ids.to(device), w.to(device)


def test_replayed_calls_match_eager_and_pad_with_no_expert(ckpt):
    """Calls of 1 to 8 rows on experts 1-6 of the 8 (so ids reach -1 and the edges of the local
    slots) replay the bucket at or above them: the eager kernels' sums to rounding (the CPU
    kernel choice may time other kernels for a bucket's shape than for the call's), each call
    its own tensor (a later replay of the same graph does not touch an earlier result), and
    the padded rows computed by no expert."""
    ex = _experts(ckpt, ids=[1, 2, 3, 4, 5, 6])
    H = ex.cfg.hidden_size
    assert H == 64
    ex.graphs = _graphs(ex, max_rows=8)
    assert sorted(ex.graphs.buckets) == [1, 2, 4, 8]
    results = []
    for i, n in enumerate([1, 2, 3, 5, 8, 3]):
        for layer in (1, 2):
            x, ids, w = _call(n, 6, seed=10 * i + layer)
            got = ex.compute(layer, x, ids, w)
            want = ex.compute_eager(layer, x, ids, w)
            assert got.shape == (n, H)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            results.append((got, got.clone()))
    # the router's int64 ids (colocated) replay as the transport's int32 ones
    x, ids, w = _call(5, 6, seed=99)
    got = ex.compute(1, x, ids.long(), w)
    torch.testing.assert_close(got, ex.compute_eager(1, x, ids, w), rtol=1e-5, atol=1e-5)
    assert ex.graphs.replays == 13
    for got, copy in results:
        assert torch.equal(got, copy)
    b = ex.graphs.buckets[4]
    assert (b.ids[3:] == -1).all()  # the last call of 3 rows: its padding is no expert's
    # a padded row's sum is what no expert adds: zero (its stale inputs are never read)
    assert (b.out[3:] == 0).all()
    assert all(seg.outputs is b.out for seg in b.segments.values())  # one output per bucket


def test_calls_that_run_eagerly(ckpt):
    ex = _experts(ckpt)
    ex.graphs = _graphs(ex, max_rows=4)
    x, ids, w = _call(5, 8, seed=1)
    assert ex.graphs.replay(1, x, ids, w) is None  # more rows than the largest bucket
    assert ex.graphs.replay(1, x[:0], ids[:0], w[:0]) is None  # no rows
    assert ex.graphs.replay(0, x[:2], ids[:2], w[:2]) is None  # not an MoE layer
    torch.testing.assert_close(ex.compute(1, x, ids, w), ex.compute_eager(1, x, ids, w))
    assert ex.graphs.replays == 0


def test_weights_changed_in_place_are_read_and_replaced_ones_run_eagerly(ckpt, caplog):
    """A rebalance copies new experts into the captured tensors (read by the next replay); a
    layer whose weight tensors were swapped for others runs eagerly, with one warning."""
    ex = _experts(ckpt)
    ex.graphs = _graphs(ex, max_rows=4)
    x, ids, w = _call(3, 8, seed=2)
    before = ex.compute(1, x, ids, w)
    w13, w2 = ex.weights[1]
    w13[ids[0, 0].clamp(min=0)].mul_(2.0)  # in place, as `LocalExperts.apply` does
    after = ex.compute(1, x, ids, w)
    assert ex.graphs.replays == 2 and not torch.equal(before, after)
    torch.testing.assert_close(after, ex.compute_eager(1, x, ids, w), rtol=1e-5, atol=1e-5)
    ex.weights[1] = (w13.clone(), w2.clone())  # new tensors: the graph would read stale ones
    with caplog.at_level(logging.WARNING, logger="splitmoe"):
        for _ in range(2):
            torch.testing.assert_close(ex.compute(1, x, ids, w), ex.compute_eager(1, x, ids, w))
    assert ex.graphs.replays == 2
    warned = [r for r in caplog.records if "were replaced" in r.getMessage()]
    assert len(warned) == 1
    assert ex.graphs.replay(2, x, ids, w) is not None  # the other layer still replays


def test_no_op_on_cpu_and_when_eager(ckpt):
    ex = _experts(ckpt)
    ex.capture_graphs(True, 8, 2)  # the engine's call: CUDA graphs on CPU capture nothing
    assert ex.graphs is None
    ex.capture_graphs(False, 8, 2)
    assert ex.graphs is None


class _FailingCapture(RerunSegment):
    """A capture that fails as CUDA's does when a kernel syncs with the host mid-capture."""

    def __init__(self, fn, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_capture_failure_falls_back_with_one_warning(ckpt, caplog):
    ex = _experts(ckpt)
    with caplog.at_level(logging.WARNING, logger="splitmoe"):
        assert _graphs(ex, 4, _FailingCapture) is None
    warned = [r for r in caplog.records if "capture of the experts failed" in r.getMessage()]
    assert len(warned) == 1 and "not permitted" in warned[0].getMessage()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_match_eager_on_a_gpu(ckpt):
    """Captured for real on the GPU (Triton kernels, float32): every bucket of 16 rows, the
    eager kernels' sums bit for bit where the call fills its bucket (the same kernels on the
    same shapes), to rounding where it is padded (the tiles follow the row count)."""
    dev = torch.device("cuda")
    ex = _experts(ckpt, dev, ids=[0, 2, 4, 6, 7])
    ex.capture_graphs(True, 16, 2)
    assert ex.graphs is not None and sorted(ex.graphs.buckets) == [1, 2, 4, 8, 16]
    for i, n in enumerate([1, 2, 3, 8, 13, 16]):
        for layer in (1, 2):
            x, ids, w = _call(n, 5, seed=100 + 10 * i + layer, device=dev)
            got = ex.compute(layer, x, ids, w)
            want = ex.compute_eager(layer, x, ids, w)
            if n in ex.graphs.buckets:
                assert torch.equal(got, want), (n, layer)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert ex.graphs.replays == 12
