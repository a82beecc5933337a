"""CUDA graphs of decode steps (`splitmoe.attention_nodes.graphs`), what runs without a GPU:
buckets, padding, the no-op on CPU, the fallback when capture fails, and the static-buffer
plumbing (segments chained through their outputs, padded rows, unpadded views) replayed with
`RerunSegment` against the eager forward, bit for bit in float32. The CUDA capture itself is
checked by `scripts/gpu_check.sh` on a lent GPU."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import make_tiny_checkpoint

from splitmoe.attention_nodes.graphs import DecodeGraphs, pad_meta
from splitmoe.attention_nodes.kv_cache import PagedKVCache
from splitmoe.attention_nodes.model import AttentionModel, MicroBatch
from splitmoe.cuda_graphs import RerunSegment, bucket_for, capture_sizes, pad_rows
from splitmoe.expert_nodes.experts import LocalExperts
from splitmoe.kernels.attention_metadata import AttentionMetadata
from splitmoe.kernels.backends import attention_backend, moe_backend
from splitmoe.models.config import ModelConfig
from splitmoe.models.loader import load_attention_weights
from splitmoe.options import engine_config

CPU = torch.device("cpu")
BLOCK = 4
UNWRITTEN = 12345.0  # (finite: masked keys are read, with a weight of 0)


def test_capture_sizes_and_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]  # rounded up to a bucket
    assert capture_sizes(10_000)[-1] == 512
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == [
        1, 2, 4, 8, 8, 16, 64, 64,
    ]  # fmt: skip
    assert bucket_for(0, sizes) is None and bucket_for(65, sizes) is None
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_pad_rows_repeats_the_last_row():
    t = torch.arange(6.0).view(3, 2)
    out = pad_rows(t, 5)
    assert torch.equal(out[:3], t) and torch.equal(out[3:], t[2:].expand(2, 2))
    buf = torch.full((4, 2), -1.0)
    assert pad_rows(t, 4, buf) is buf and torch.equal(buf[3], t[2])
    with pytest.raises(ValueError):
        pad_rows(t, 2)
    with pytest.raises(ValueError):
        pad_rows(t[:0], 2)


def test_pad_meta_repeats_the_last_sequence():
    meta = AttentionMetadata.from_lists([1, 1], [5, 9], [[3, 4], [7, 8, 2]], [17, 34])
    out = AttentionMetadata(
        query_start_loc=torch.arange(5),
        seq_lens=torch.zeros(4, dtype=torch.int64),
        block_tables=torch.full((4, 6), -1, dtype=torch.int32),
        slot_mapping=torch.zeros(4, dtype=torch.int64),
        query_lens=[1] * 4,
        seq_lens_list=[64] * 4,
    )
    pad_meta(meta, out)
    assert out.seq_lens.tolist() == [5, 9, 9, 9]
    assert out.slot_mapping.tolist() == [17, 34, 34, 34]
    assert out.block_tables[:, :3].tolist() == [[3, 4, 0], [7, 8, 2], [7, 8, 2], [7, 8, 2]]
    prefill = AttentionMetadata.from_lists([2], [2], [[1]], [4, 5])
    with pytest.raises(ValueError, match="does not fit"):
        pad_meta(prefill, out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 3-layer Qwen3-MoE (layer 0 dense) on CPU, float32: model, local experts, config."""
    path = make_tiny_checkpoint(
        "qwen3_moe", tmp_path_factory.mktemp("graphs"), num_layers=3, mlp_only_layers=[0]
    )
    cfg = ModelConfig.from_hf(path)
    g, layers = load_attention_weights(cfg, torch.float32, "cpu")
    model = AttentionModel(cfg, g, layers, CPU, attention_backend("torch", CPU))
    experts = LocalExperts(
        cfg, list(range(cfg.num_experts)), torch.float32, CPU, moe_backend("torch", CPU)
    )
    return model, experts, cfg


def _cache(cfg) -> PagedKVCache:
    return PagedKVCache(
        cfg.num_layers, 32, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU
    )


def _batch(ids: list[list[int]], starts: list[int], tables: list[list[int]]) -> MicroBatch:
    """The micro-batch of sequences taking ``ids[i]`` from position ``starts[i]``."""
    flat, pos, slots = [], [], []
    for toks, s, table in zip(ids, starts, tables):
        for p in range(s, s + len(toks)):
            pos.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
        flat += toks
    meta = AttentionMetadata.from_lists(
        [len(t) for t in ids], [s + len(t) for t, s in zip(ids, starts)], tables, slots
    )
    return MicroBatch(torch.tensor(flat), torch.tensor(pos), meta)


def test_replayed_decode_matches_eager(tiny):
    """Three sequences prefilled eagerly, then decode steps replayed from the captured
    segments: of 1 and 2 sequences (buckets of their size), then of 3 (padded to 4): the eager
    forward's hidden states and KV cache, to rounding (a wrong row, a stale input or a padded
    row writing elsewhere is off by far more)."""
    model, experts, cfg = tiny
    prompts = [[5, 9, 2, 7, 1, 4, 4, 6, 3], [3, 3], [8, 1, 4, 6, 2, 9, 11, 2, 7]]
    tables = [[1, 2, 3], [4, 5], [6, 7, 8]]
    # (the reference decode attention reads as many keys as the longest context of the step,
    # a graph as many as max_model_len = 12, masked: the unpadded steps' contexts reach the
    # third block, so that both read the same keys)
    steps = [([2], 17), ([0, 2], 13), ([0, 1, 2], 19)]
    runs = {}
    # (bit-exact agreement is not asked: `linear`'s CPU kernel choice alternates oneDNN and MKL
    # over a shape's first calls to time them, and they round differently)
    for mode in ("eager", "graphs"):
        kv = _cache(cfg)
        for i in range(cfg.num_layers):
            for t in kv.layer(i):
                t.fill_(UNWRITTEN)
        if mode == "eager":  # the warm-up's rows, as capturing stores them
            for i in range(cfg.num_layers):
                for t in kv.layer(i):
                    t[0, 0] = 0.0
        graphs = DecodeGraphs(model, kv, 4, 12, BLOCK, segment_cls=RerunSegment)
        if mode == "graphs":
            graphs.capture()  # (its warm-up stores into slot 0: block 0, no sequence's)
            assert sorted(graphs.buckets) == [1, 2, 4]
        done = [0, 0, 0]
        outs, kvs = [], []
        with torch.inference_mode():
            model.forward([_batch(prompts, [0, 0, 0], tables)], kv, experts)
            for rows, tok in steps:
                mb = _batch(
                    [[tok + r] for r in rows],
                    [len(prompts[r]) + done[r] for r in rows],
                    [tables[r] for r in rows],
                )
                for r in rows:
                    done[r] += 1
                seg = graphs.segment(mb.meta.query_lens) if mode == "graphs" else None
                assert (seg is None) == (mode == "eager")
                outs.append(model.forward([mb], kv, experts, segment=seg)[0])
                kvs.append([t.clone() for i in range(3) for t in kv.layer(i)])
        assert graphs.replays == (len(steps) if mode == "graphs" else 0)
        runs[mode] = outs, kvs
    (want, kv_want), (got, kv_got) = runs["eager"], runs["graphs"]
    for step, (rows, _) in enumerate(steps):
        assert got[step].shape == want[step].shape == (len(rows), cfg.hidden_size)
        torch.testing.assert_close(got[step], want[step], rtol=1e-5, atol=1e-5)
        for g, w in zip(kv_got[step], kv_want[step]):
            # the same slots written (the padded rows wrote only into their real row's slot;
            # the cache starts as UNWRITTEN), the same values there
            assert torch.equal(g == UNWRITTEN, w == UNWRITTEN)
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_steps_that_are_not_plain_decode_run_eagerly(tiny):
    model, _, cfg = tiny
    graphs = DecodeGraphs(model, _cache(cfg), 4, 12, BLOCK, segment_cls=RerunSegment)
    graphs.capture()
    assert graphs.segment([1, 2]) is None  # a prompt chunk in the step
    assert graphs.segment([1] * 5) is None  # more sequences than the largest bucket
    assert graphs.segment([]) is None
    assert graphs.segment([1, 1]) is not None


def test_no_op_on_cpu_and_when_eager(tiny):
    model, _, cfg = tiny
    kv = _cache(cfg)
    assert DecodeGraphs.create(model, kv, CPU, True, 4, 12, BLOCK) is None
    assert DecodeGraphs.create(model, kv, CPU, False, 4, 12, BLOCK, RerunSegment) is None
    made = DecodeGraphs.create(model, kv, CPU, True, 4, 12, BLOCK, RerunSegment)
    assert made is not None and sorted(made.buckets) == [1, 2, 4]
    # the engine option: graphs only on CUDA and only with enforce_eager=False
    ec = engine_config(cfg, device="cpu", dtype="float32", enforce_eager=False)
    assert ec.compile_model and not ec.cuda_graphs
    assert not engine_config(cfg, device="cpu", enforce_eager=True).cuda_graphs
    assert not engine_config(cfg, device="cpu").cuda_graphs


class _FailingCapture(RerunSegment):
    """A capture that fails as CUDA's does when a kernel syncs with the host mid-capture."""

    def __init__(self, fn, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_capture_failure_falls_back_with_one_warning(tiny, caplog):
    model, _, cfg = tiny
    with caplog.at_level(logging.WARNING, logger="splitmoe"):
        made = DecodeGraphs.create(model, _cache(cfg), CPU, True, 4, 12, BLOCK, _FailingCapture)
    assert made is None
    warnings = [r for r in caplog.records if "CUDA graph capture failed" in r.getMessage()]
    assert len(warnings) == 1 and "not permitted" in warnings[0].getMessage()
