"""The native CPU kernels (``attention_backend="cpu"``) against their PyTorch references: decode
attention over a scattered paged cache, the mixed-batch entry point, RMSNorm, the fused per-head
norm + RoPE, the wrappers' input checks, the build cache, and the config that selects them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from small_default import write_small_model

import splitmoe.kernels.paged_attention as pa
from splitmoe.attention_nodes.model import AttentionModel, rms_norm, rope_rows
from splitmoe.comm.transport import FlatTransport
from splitmoe.config import EngineConfig, ModelConfig
from splitmoe.kernels import cpu_native
from splitmoe.kernels.fused_moe import fused_moe_ref
from splitmoe.kernels.paged_attention import (
    AttentionMetadata,
    paged_attention,
    paged_attention_ref,
    store_kv,
)

if not cpu_native.available():
    pytest.skip(
        "splitmoe's CPU kernels cannot be built here (no C compiler?)", allow_module_level=True
    )


def _paged_batch(seqs, nh, nkv, d, block_size, g, num_blocks=None):
    """A step over a paged cache with scattered (randomly permuted) block ids.

    ``seqs``: ``(cached tokens, new tokens)`` per sequence. Returns ``(qkv, q, k_cache, v_cache,
    meta)`` where ``q [T, nh, d]`` is the strided query view of ``qkv [T, (nh + 2 nkv) d]``."""
    blocks_needed = sum(-(-(c + n) // block_size) for c, n in seqs)
    num_blocks = num_blocks or blocks_needed + 7
    k_cache = torch.zeros(num_blocks, block_size, nkv, d)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots = [], []
    for cached, new in seqs:
        ctx = cached + new
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        tables.append(table)
        k = torch.randn(ctx, nkv, d, generator=g)
        v = torch.randn(ctx, nkv, d, generator=g)
        pos = torch.arange(ctx)
        slot = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        store_kv(k, v, k_cache, v_cache, slot)  # the prefix and this step's tokens alike
        slots.append(slot[cached:])
    T = sum(n for _, n in seqs)
    qkv = torch.randn(T, (nh + 2 * nkv) * d, generator=g)
    q = qkv.view(T, nh + 2 * nkv, d)[:, :nh]
    meta = AttentionMetadata.from_lists(
        [n for _, n in seqs], [c + n for c, n in seqs], tables, torch.cat(slots)
    )
    return qkv, q, k_cache, v_cache, meta


def _strided_out(T, nh, d):
    """An output view ``[T, nh, d]`` with padding between rows and heads, filled with NaN; and
    the buffer it lives in (so that writes outside the view can be seen)."""
    buf = torch.full((T, nh + 1, d + 4), float("nan"))
    return buf[:, 1:, 2 : d + 2], buf


def _rope(positions, d, theta=10000.0):
    """``cos, sin [T, 1, d]`` as `AttentionModel.rope` (sin's first half negated)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    cos, sin = rope_rows(inv_freq, positions)
    return cos[:, None, :], sin[:, None, :]


# --- decode attention -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nh,nkv,d", [(4, 4, 16), (16, 1, 16), (4, 2, 32), (8, 1, 64), (4, 2, 128), (6, 2, 20)]
)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_matches_ref(nh, nkv, d, block_size):
    """A pure decode step: context lengths 1, a block multiple, one past it, and others; q is a
    strided view of qkv and out a strided view with padding, which the kernel must not touch.
    Head dims 16-128 take the 16-lane path (more query heads per KV head than it keeps in
    registers at once: 16 of 16, 8 of 64), 20 the general one."""
    g = torch.Generator().manual_seed(nh * 1000 + d * 10 + block_size)
    lens = [1, 2 * block_size, 2 * block_size + 1, 37, 5, 3 * block_size - 1]
    qkv, q, k_cache, v_cache, meta = _paged_batch(
        [(n - 1, 1) for n in lens], nh, nkv, d, block_size, g
    )
    qkv_before = qkv.clone()
    scale = d**-0.5
    out, buf = _strided_out(len(lens), nh, d)
    assert cpu_native.decode_attention(q, k_cache, v_cache, meta, scale, out) == len(lens)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    outside = torch.ones(buf.shape, dtype=torch.bool)
    outside[:, 1:, 2 : d + 2] = False
    assert buf[outside].isnan().all(), "decode_attention wrote outside out's view"
    assert torch.equal(qkv, qkv_before)


def test_decode_returns_zero_without_decode_rows():
    g = torch.Generator().manual_seed(1)
    _, q, k_cache, v_cache, meta = _paged_batch([(0, 5), (3, 4)], 4, 2, 16, 4, g)
    out = torch.full(q.shape, float("nan"))
    assert cpu_native.decode_attention(q, k_cache, v_cache, meta, 0.25, out) == 0
    assert out.isnan().all()


@pytest.mark.parametrize("nh,nkv,d", [(4, 4, 16), (4, 2, 32), (6, 2, 20)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("batched", [False, True])
def test_mixed_batch_matches_ref(nh, nkv, d, block_size, batched, monkeypatch):
    """Decode rows, fresh prompts and a chunk extending a cached prefix in one step through
    ``paged_attention(backend="cpu")``: decode rows from the kernel, prompt rows from the
    reference (batched into one padded SDPA, or one sequence at a time)."""
    monkeypatch.setattr(pa, "PREFILL_MAX_PADDING", 1e9 if batched else 0.0)
    g = torch.Generator().manual_seed(0)
    seqs = [(0, 1), (9, 1), (0, 13), (5, 7), (33, 1), (16, 16), (block_size - 1, 1)]
    decode = [i for i, (_, n) in enumerate(seqs) if n == 1]
    _, q, k_cache, v_cache, meta = _paged_batch(seqs, nh, nkv, d, block_size, g)
    scale = d**-0.5
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    out = paged_attention(q, k_cache, v_cache, meta, scale, backend="cpu")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

    starts = meta.query_start_loc.tolist()
    decode_rows = [starts[i] for i in decode]
    prompt_rows = [r for r in range(q.shape[0]) if r not in decode_rows]
    assert torch.equal(out[prompt_rows], ref[prompt_rows]), "prompt rows are the reference's"

    # The kernel alone writes exactly the decode rows and counts their sequences.
    alone = torch.full(q.shape, float("nan"))
    assert cpu_native.decode_attention(q, k_cache, v_cache, meta, scale, alone) == len(decode)
    torch.testing.assert_close(alone[decode_rows], ref[decode_rows], atol=1e-5, rtol=1e-5)
    assert alone[prompt_rows].isnan().all()


def test_decode_int32_metadata():
    """seq_lens and query_start_loc as int32 (the kernel reads int64 lengths: converted once)."""
    g = torch.Generator().manual_seed(2)
    _, q, k_cache, v_cache, meta = _paged_batch([(6, 1), (0, 3), (20, 1)], 4, 2, 16, 4, g)
    meta.seq_lens = meta.seq_lens.int()
    meta.query_start_loc = meta.query_start_loc.int()
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.25)
    out = paged_attention(q, k_cache, v_cache, meta, 0.25, backend="cpu")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_scale", [1.0, 30.0])
def test_long_context_and_peaked_softmax(q_scale):
    """~600 keys over 16-token blocks (the scores buffer sized by the longest sequence, many
    blocks) beside a short sequence; with the query scaled up the scores spread over hundreds,
    the softmax is nearly one-hot and exponents go below the kernel's -87.3 clamp."""
    nh, nkv, d, bs = 8, 2, 32, 16
    g = torch.Generator().manual_seed(7)
    seqs = [(600, 1), (4, 1), (0, 9), (129, 1)]
    qkv, q, k_cache, v_cache, meta = _paged_batch(seqs, nh, nkv, d, bs, g)
    q.mul_(q_scale)
    scale = d**-0.5
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    out = torch.full(q.shape, float("nan"))
    assert cpu_native.decode_attention(q, k_cache, v_cache, meta, scale, out) == 3
    rows = [0, 1, 11]
    torch.testing.assert_close(out[rows], ref[rows], atol=1e-5, rtol=1e-5)
    out = paged_attention(q, k_cache, v_cache, meta, scale, backend="cpu")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if q_scale > 1:  # the case really is peaked: the top key holds most of the weight
        k = k_cache[meta.block_tables[0, :38].long()].flatten(0, 1)[:601, 0]  # KV head 0
        p = (q[0, 0] @ k.T * scale).softmax(-1)
        assert p.max() > 0.5


# --- RMSNorm and norm + RoPE ------------------------------------------------------------------


@pytest.mark.parametrize("T", [0, 1, 7, 33])
@pytest.mark.parametrize("H", [24, 128])
@pytest.mark.parametrize("with_weight", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_matches_ref(T, H, with_weight, strided):
    g = torch.Generator().manual_seed(T * 1000 + H)
    eps = 1e-6
    x = torch.randn(T, H + 8 if strided else H, generator=g) * 3.0
    x = x[:, :H] if strided else x  # rows further apart than H
    weight = torch.randn(H, generator=g) if with_weight else None
    x_before = x.clone()
    out = cpu_native.rms_norm(x, weight, eps)
    assert out.shape == (T, H) and out.dtype == torch.float32
    torch.testing.assert_close(out, rms_norm(x, weight, eps), atol=1e-6, rtol=1e-5)
    assert torch.equal(x, x_before)
    if T == 0:
        assert out.numel() == 0


@pytest.mark.parametrize("nh,nkv,d", [(4, 2, 16), (8, 1, 20), (2, 2, 64)])
@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("with_weight", [True, False])
def test_norm_rope_matches_ref(nh, nkv, d, T, with_weight):
    """In place on the q and k heads of ``qkv`` (a strided view); the v heads stay untouched."""
    g = torch.Generator().manual_seed(nh * 100 + d + T)
    eps = 1e-6
    heads = nh + nkv
    qkv = torch.randn(T, (nh + 2 * nkv) * d, generator=g)
    x = qkv.view(T, nh + 2 * nkv, d)[:, :heads]
    weight = torch.rand(heads, d, generator=g) + 0.5 if with_weight else None
    cos, sin = _rope(torch.arange(T) + 100, d)
    before = qkv.clone()
    if with_weight:
        expected = AttentionModel.apply_rope(rms_norm(x, None, eps) * weight, (cos, sin))
    else:
        expected = AttentionModel.apply_rope(x.clone(), (cos, sin))
    result = cpu_native.norm_rope_(x, weight, eps, cos, sin)
    assert result is x
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)
    v = qkv.view(T, nh + 2 * nkv, d)[:, heads:]
    assert torch.equal(v, before.view(T, nh + 2 * nkv, d)[:, heads:]), "v heads changed"


def test_norm_rope_arbitrary_positions():
    """Positions out of order and far apart (each row rotated by its own angle)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 32, generator=g)
    weight = torch.rand(3, 32, generator=g) + 0.5
    cos, sin = _rope(torch.tensor([7, 0, 1000, 3, 511]), 32, theta=1e6)
    expected = AttentionModel.apply_rope(rms_norm(x, None, 1e-5) * weight, (cos, sin))
    cpu_native.norm_rope_(x, weight, 1e-5, cos, sin)
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)


def test_norms_where_eps_matters():
    """Rows whose mean square is of the order of eps, and an all-zero row (0, not NaN)."""
    g = torch.Generator().manual_seed(5)
    eps = 1e-5
    x = torch.randn(4, 48, generator=g) * torch.tensor([[1e-3], [3e-3], [0.0], [1.0]])
    weight = torch.randn(48, generator=g)
    torch.testing.assert_close(
        cpu_native.rms_norm(x, weight, eps), rms_norm(x, weight, eps), atol=1e-6, rtol=1e-5
    )
    heads = x.view(4, 3, 16).clone()
    head_weight = torch.rand(3, 16, generator=g) + 0.5
    cos, sin = _rope(torch.arange(4), 16)
    expected = AttentionModel.apply_rope(rms_norm(heads, None, eps) * head_weight, (cos, sin))
    cpu_native.norm_rope_(heads, head_weight, eps, cos, sin)
    torch.testing.assert_close(heads, expected, atol=1e-5, rtol=1e-5)
    assert not heads.isnan().any()


# --- bad input --------------------------------------------------------------------------------


def test_decode_rejects_bad_input():
    g = torch.Generator().manual_seed(0)
    nh, nkv, d, bs = 4, 2, 16, 4
    _, q, k_cache, v_cache, meta = _paged_batch([(3, 1), (8, 1)], nh, nkv, d, bs, g)
    out = torch.empty(q.shape)
    with pytest.raises(ValueError, match="q must be a float32"):
        cpu_native.decode_attention(q.double(), k_cache, v_cache, meta, 0.25, out)
    padded = torch.zeros(*k_cache.shape[:-1], 2 * d)[..., :d]
    padded.copy_(k_cache)
    assert padded.stride(-1) == 1 and not padded.is_contiguous()
    with pytest.raises(ValueError, match="k_cache and v_cache must be contiguous"):
        cpu_native.decode_attention(q, padded, v_cache, meta, 0.25, out)
    with pytest.raises(ValueError, match="out must be a float32"):
        cpu_native.decode_attention(q, k_cache, v_cache, meta, 0.25, out.transpose(1, 2))


def test_rms_norm_rejects_bad_input():
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match=r"rms_norm takes \[T, H\] rows"):
        cpu_native.rms_norm(x.view(3, 2, 8), None, 1e-6)
    with pytest.raises(ValueError, match=r"weight \(15,\) for x \(3, 16\)"):
        cpu_native.rms_norm(x, torch.ones(15), 1e-6)
    with pytest.raises(ValueError, match="x must be a float32"):
        cpu_native.rms_norm(x.half(), None, 1e-6)


def test_norm_rope_rejects_bad_input():
    cos, sin = _rope(torch.arange(2), 16)
    with pytest.raises(ValueError, match="head_dim 15 must be even"):
        c, s = cos[..., :15].contiguous(), sin[..., :15].contiguous()
        cpu_native.norm_rope_(torch.randn(2, 3, 15), None, 1e-6, c, s)
    with pytest.raises(ValueError, match=r"cos must be \[2, 1, 16\]"):
        cpu_native.norm_rope_(torch.randn(2, 3, 16), None, 1e-6, cos[:1], sin)
    with pytest.raises(ValueError, match=r"cos must be \[2, 1, 16\]"):
        cpu_native.norm_rope_(torch.randn(2, 3, 16), None, 1e-6, cos.view(2, 16), sin)
    with pytest.raises(ValueError, match=r"weight \(2, 16\) for 3 heads of 16"):
        cpu_native.norm_rope_(torch.randn(2, 3, 16), torch.ones(2, 16), 1e-6, cos, sin)


# --- build ------------------------------------------------------------------------------------


def test_build_is_cached(tmp_path, monkeypatch):
    lib = cpu_native.build(tmp_path)
    assert lib.is_file() and lib.parent == tmp_path

    def no_compile(*args, **kwargs):
        raise AssertionError(f"recompiled: {args}")

    monkeypatch.setattr(cpu_native.subprocess, "run", no_compile)
    assert cpu_native.build(tmp_path) == lib
    assert sorted(p.name for p in tmp_path.iterdir()) == [lib.name]  # no temporary left over


def test_build_without_compiler(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_native, "_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="C compiler") as e:
        cpu_native.build(tmp_path / "other")
    assert "attention_backend='torch'" in str(e.value)
    assert not (tmp_path / "other").exists()


# --- config -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_cfg(tmp_path_factory):
    return ModelConfig.from_hf(write_small_model(tmp_path_factory.mktemp("cpu-native") / "m"))


@pytest.fixture
def one_thread():
    """A rank's thread count: "auto" picks the (single-threaded) native kernels only there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_config_auto_is_native_with_threads(model_cfg):
    """The decode layer and the fused MoE split their work over the rank's threads, so "auto"
    keeps the native kernels for ranks given several."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cfg = EngineConfig(model=model_cfg, device="cpu", dtype="float32")
        assert cfg.backend("attention_backend") == cfg.backend("moe_backend") == "cpu"
        forced = EngineConfig(model=model_cfg, attention_backend="torch", moe_backend="torch")
        assert forced.backend("attention_backend") == forced.backend("moe_backend") == "torch"
    finally:
        torch.set_num_threads(before)


def test_config_cpu_backend(model_cfg, one_thread):
    with pytest.raises(ValueError, match="float32"):
        EngineConfig(model=model_cfg, attention_backend="cpu", dtype="bfloat16", device="cpu")
    with pytest.raises(ValueError, match="float32"):
        EngineConfig(model=model_cfg, attention_backend="cpu", dtype="bfloat16")
    with pytest.raises(ValueError, match="moe_backend='cpu' runs float32"):
        EngineConfig(model=model_cfg, moe_backend="cpu", dtype="bfloat16", device="cpu")
    cfg = EngineConfig(model=model_cfg, device="cpu", dtype="float32")
    assert cfg.backend("attention_backend") == "cpu"
    assert cfg.backend("moe_backend") == "cpu"
    assert EngineConfig(model=model_cfg, moe_backend="torch").backend("moe_backend") == "torch"
    assert EngineConfig(model=model_cfg, device="cpu").backend("attention_backend") == "cpu"
    explicit = EngineConfig(model=model_cfg, attention_backend="cpu", device="cpu")
    assert explicit.backend("attention_backend") == "cpu"
    bf16 = EngineConfig(model=model_cfg, device="cpu", dtype="bfloat16")
    assert bf16.backend("attention_backend") == "torch"
    assert bf16.backend("moe_backend") == "torch"


# --- fused MoE --------------------------------------------------------------------------------


def _moe_case(tokens: int, E: int, H: int, I: int, k: int, skip: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.2
    w2 = torch.randn(E, H, I, generator=g) * 0.2
    x = torch.randn(tokens, H, generator=g)
    logits = torch.randn(tokens, E, generator=g) + 2.0 * torch.linspace(0, 3, E)  # skewed
    ids = logits.topk(k, dim=1).indices.to(torch.int32)
    ids[torch.rand(tokens, k, generator=g) < skip] = -1  # slots served by another rank
    w = torch.rand(tokens, k, generator=g)
    return x, w13, w2, ids, w


@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 33, 130])
@pytest.mark.parametrize("E,H,I,k", [(8, 32, 16, 3), (16, 128, 64, 4), (4, 72, 40, 2)])
@pytest.mark.parametrize("skip", [0.0, 0.5])
def test_fused_moe_matches_ref(tokens, E, H, I, k, skip):
    """Row tiles of 4 and single rows, whole column tiles and leftover columns (H 72, 2I 80 are
    not multiples of the tile width), experts without tokens, slots served elsewhere."""
    x, w13, w2, ids, w = _moe_case(tokens, E, H, I, k, skip, seed=tokens * 7 + E)
    want = fused_moe_ref(x, w13, w2, ids, w)
    got = cpu_native.fused_moe(x, *cpu_native.expert_layout(w13, w2), ids, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got64 = cpu_native.fused_moe(x, *cpu_native.expert_layout(w13, w2), ids.long(), w)
    assert torch.equal(got64, got)  # int32 and int64 ids alike


def test_fused_moe_all_slots_elsewhere_gives_zeros():
    x, w13, w2, ids, w = _moe_case(6, 8, 32, 16, 2, 0.0, seed=1)
    got = cpu_native.fused_moe(x, *cpu_native.expert_layout(w13, w2), torch.full_like(ids, -1), w)
    assert torch.equal(got, torch.zeros_like(x))


def test_fused_moe_rejects_bad_input():
    x, w13, w2, ids, w = _moe_case(5, 8, 32, 16, 2, 0.0, seed=2)
    w13t, w2t = cpu_native.expert_layout(w13, w2)
    with pytest.raises(ValueError, match="shapes do not fit"):
        cpu_native.fused_moe(x, w13, w2, ids, w)  # the loader's layout, not the kernel's
    with pytest.raises(ValueError, match="float32"):
        cpu_native.fused_moe(x.double(), w13t, w2t, ids, w)
    with pytest.raises(ValueError, match="routing"):
        cpu_native.fused_moe(x, w13t, w2t, ids[:, :1], w)
    with pytest.raises(ValueError, match="expert id >= 8"):
        cpu_native.fused_moe(x, w13t, w2t, torch.full_like(ids, 8), w)
    with pytest.raises(ValueError, match="up to 64 experts per token"):
        cpu_native.fused_moe(x, w13t, w2t, torch.zeros(5, 65, dtype=torch.int64), torch.ones(5, 65))


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_fused_moe_reads_packed_rows_in_place(tokens):
    """An expert rank's received rows (`Transport.pack`'s layout) give the same bits read in
    place (`fused_moe_rows`) as unpacked, and so do `Transport.unpack`'s views of them."""
    E, H, I, k = 16, 72, 40, 4
    x, w13, w2, ids, w = _moe_case(tokens, E, H, I, k, 0.5, seed=tokens)
    w13t, w2t = cpu_native.expert_layout(w13, w2)
    rows = torch.cat([x.view(torch.uint8), ids.view(torch.uint8), w.view(torch.uint8)], dim=1)
    want = cpu_native.fused_moe(x, w13t, w2t, ids, w)
    assert torch.equal(cpu_native.fused_moe_rows(rows, k, w13t, w2t), want)
    t = object.__new__(FlatTransport)  # (unpack needs only the row layout)
    t.hidden_size, t.top_k, t.dtype, t.elem, t.row_bytes = H, k, torch.float32, 4, rows.shape[1]
    vx, vids, vw = t.unpack(rows)
    assert vx.data_ptr() == rows.data_ptr() and vx.stride(0) == rows.shape[1] // 4  # a view
    assert torch.equal(vx, x) and torch.equal(vids, ids) and torch.equal(vw, w)
    assert torch.equal(cpu_native.fused_moe(vx, w13t, w2t, vids, vw), want)


def test_fused_moe_rows_rejects_bad_input():
    x, w13, w2, ids, w = _moe_case(5, 8, 32, 16, 2, 0.0, seed=3)
    w13t, w2t = cpu_native.expert_layout(w13, w2)
    rows = torch.cat([x.view(torch.uint8), ids.view(torch.uint8), w.view(torch.uint8)], dim=1)
    with pytest.raises(ValueError, match=r"uint8 rows \[N, 144\]"):
        cpu_native.fused_moe_rows(rows[:, :-4], 2, w13t, w2t)
    with pytest.raises(ValueError, match="uint8 rows"):
        cpu_native.fused_moe_rows(x, 2, w13t, w2t)
    with pytest.raises(ValueError, match="expert_layout"):
        cpu_native.fused_moe_rows(rows, 2, w13t, w2t[:, :8].contiguous())
    bad = rows.clone()
    bad[0, 128:132] = torch.tensor([8], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(ValueError, match="expert id >= 8"):
        cpu_native.fused_moe_rows(bad, 2, w13t, w2t)


# --- router and KV store ----------------------------------------------------------------------


@pytest.mark.parametrize("T,E,k", [(0, 8, 2), (1, 8, 1), (37, 16, 4), (5, 60, 8), (3, 4, 4)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_matches_torch(T, E, k, renormalize):
    g = torch.Generator().manual_seed(T * 100 + E)
    logits = torch.randn(T, E, generator=g) * 3
    probs = logits.softmax(-1)
    want_w, want_ids = probs.topk(k, dim=-1)
    if renormalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    ids, w = cpu_native.route(logits, k, renormalize)
    assert ids.dtype == torch.int64 and ids.shape == (T, k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)


def test_route_rejects_bad_input():
    with pytest.raises(ValueError, match="k <= E"):
        cpu_native.route(torch.randn(3, 4), 5, True)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_native.route(torch.randn(4, 3).t(), 2, True)


def test_store_kv_matches_torch():
    g = torch.Generator().manual_seed(5)
    T, nh, nkv, d = 6, 4, 2, 16
    qkv = torch.randn(T, nh + 2 * nkv, d, generator=g)
    k, v = qkv[:, nh : nh + nkv], qkv[:, nh + nkv :]
    slots = torch.randperm(40, generator=g)[:T]
    want_k, want_v = torch.zeros(10, 4, nkv, d), torch.zeros(10, 4, nkv, d)
    store_kv(k, v, want_k, want_v, slots)
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    cpu_native.store_kv(k, v, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    with pytest.raises(ValueError, match="int64"):
        cpu_native.store_kv(k, v, got_k, got_v, slots.int())


# --- dispatch rows ----------------------------------------------------------------------------


def _route_pack_ref(x, slots, weights, slot_rank, slot_local, R):
    """The definition: a row per (token, distinct destination rank), destinations ascending,
    tokens ascending within one; x bytes, then int32 local ids (-1 elsewhere), then the token's
    float32 weights."""
    rows, tokens, counts = [], [], [0] * R
    for r in range(R):
        for t in range(slots.shape[0]):
            dest = [int(slot_rank[s]) for s in slots[t]]
            if r not in dest:
                continue
            ids = torch.tensor(
                [int(slot_local[s]) if d == r else -1 for s, d in zip(slots[t], dest)],
                dtype=torch.int32,
            )
            row = [x[t].contiguous().view(torch.uint8), ids.view(torch.uint8)]
            rows.append(torch.cat(row + [weights[t].float().contiguous().view(torch.uint8)]))
            tokens.append(t)
            counts[r] += 1
    width = x.shape[1] * x.element_size() + 8 * slots.shape[1]
    out = torch.stack(rows) if rows else torch.empty(0, width, dtype=torch.uint8)
    return torch.tensor(tokens, dtype=torch.int64), out, counts


@pytest.mark.parametrize("T", [0, 1, 9, 40])
@pytest.mark.parametrize("R,replicas", [(1, 0), (2, 0), (3, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_pack_matches_definition(T, R, replicas, dtype):
    g = torch.Generator().manual_seed(T * 10 + R)
    E, k, H = 8, 3, 12
    S = E + replicas  # slots: every expert once, plus replicas of the first ones
    slot_rank = torch.randint(0, R, (S,), generator=g)
    slot_rank[:R] = torch.arange(R)  # every rank owns a slot
    slot_local = torch.zeros(S, dtype=torch.int64)
    for r in range(R):
        mine = (slot_rank == r).nonzero().view(-1)
        slot_local[mine] = torch.arange(mine.numel())
    slots = torch.stack(
        [torch.randperm(S, generator=g)[:k] for _ in range(T)]
        or [torch.empty(0, k, dtype=torch.int64)]
    ).view(T, k)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = torch.rand(T, k, generator=g)
    want = _route_pack_ref(x, slots, w, slot_rank, slot_local, R)
    tokens, rows, counts = cpu_native.route_pack(x, slots, w, slot_rank, slot_local, R)
    assert torch.equal(tokens, want[0]) and counts == want[2]
    assert torch.equal(rows, want[1])


def test_route_pack_rejects_bad_slots():
    slot_rank, slot_local = torch.zeros(4, dtype=torch.int64), torch.arange(4)
    x, w = torch.randn(2, 8), torch.rand(2, 2)
    with pytest.raises(ValueError, match="slot outside"):
        cpu_native.route_pack(x, torch.tensor([[0, 4], [1, 2]]), w, slot_rank, slot_local, 1)


def _rings(R: int, capacity: int) -> list[torch.Tensor]:
    """One empty shared-memory ring layout per rank (`splitmoe.comm.shm`: a 128-byte header,
    then the data), in private memory."""
    return [torch.zeros(128 + capacity, dtype=torch.uint8) for _ in range(R)]


def _frames(ring: torch.Tensor) -> list[torch.Tensor]:
    """The frames written into a ring that nobody read (8-byte length, then the bytes)."""
    end, at, out = int(ring[:8].view(torch.int64)), 0, []
    data = ring[128:]
    while at < end:
        n = int(data[at : at + 8].view(torch.int64))
        out.append(data[at + 8 : at + 8 + n].clone())
        at += 8 + n
    return out


@pytest.mark.parametrize("T", [0, 5, 40])
@pytest.mark.parametrize("mapped", [False, True])
def test_dispatch_send_frames_the_routed_rows(T, mapped):
    """One native call: the expert -> slot map, the load counts, `route_pack`'s rows and one
    frame per expert rank (empty ones too) on its ring."""
    g = torch.Generator().manual_seed(T)
    E, k, H, R = 8, 3, 12, 3  # 10 slots: two replicas
    slot_rank = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    slot_local = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 3])
    expert_slot = torch.tensor([9, 1, 2, 3, 4, 8, 6, 7]) if mapped else None
    ids = torch.stack(
        [torch.randperm(E, generator=g)[:k] for _ in range(T)]
        or [torch.empty(0, k, dtype=torch.int64)]
    ).view(T, k)
    x, w = torch.randn(T, H, generator=g), torch.rand(T, k, generator=g)
    slots = ids if expert_slot is None else expert_slot[ids]
    want_tokens, want_rows, want_counts = _route_pack_ref(x, slots, w, slot_rank, slot_local, R)
    rings = _rings(R, 1 << 14)
    send = cpu_native.DispatchSend(slot_rank, slot_local, [r.data_ptr() for r in rings], 1 << 14)
    load = torch.full((E,), 5, dtype=torch.int64)
    tokens, rows, counts, unsent = send(x, ids, w, expert_slot, load)
    assert torch.equal(tokens, want_tokens) and torch.equal(rows, want_rows)
    assert counts == want_counts and unsent == []
    assert torch.equal(load, 5 + torch.bincount(ids.flatten(), minlength=E))
    at = 0
    for r in range(R):  # each rank's rows as one frame
        (frame,) = _frames(rings[r])
        assert torch.equal(frame, want_rows[at : at + counts[r]].flatten())
        at += counts[r]


def test_dispatch_send_leaves_frames_that_do_not_fit_to_the_caller():
    slot_rank, slot_local = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1])
    x, w = torch.randn(6, 16), torch.rand(6, 2)
    ids = torch.tensor([[0, 1]] * 5 + [[2, 3]])  # rank 0 gets 5 rows (400 bytes), rank 1 one
    rings = _rings(2, 256)
    send = cpu_native.DispatchSend(slot_rank, slot_local, [r.data_ptr() for r in rings], 256)
    tokens, rows, counts, unsent = send(x, ids, w, None, None)
    assert counts == [5, 1] and unsent == [0]
    assert _frames(rings[0]) == [] and torch.equal(_frames(rings[1])[0], rows[5])


def test_dispatch_send_rejects_bad_ids_before_sending():
    slot_rank, slot_local = torch.zeros(4, dtype=torch.int64), torch.arange(4)
    rings = _rings(1, 1024)
    send = cpu_native.DispatchSend(slot_rank, slot_local, [rings[0].data_ptr()], 1024)
    load = torch.zeros(4, dtype=torch.int64)
    x, w = torch.randn(2, 8), torch.rand(2, 2)
    with pytest.raises(ValueError, match="expert id outside 0..3"):
        send(x, torch.tensor([[0, 4], [1, 2]]), w, None, load)
    assert not load.any() and _frames(rings[0]) == []


def test_out_of_range_cache_addresses_are_refused():
    """The C code reads and writes the caches through these ids: bad ones are a ValueError
    before anything is read or written, never a wild memory access."""
    k_cache, v_cache = torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8)
    q, out = torch.randn(1, 2, 8), torch.zeros(1, 2, 8)

    def meta(table, seq_len):
        return AttentionMetadata.from_lists([1], [seq_len], [table], [0])

    with pytest.raises(ValueError, match="block id"):
        cpu_native.decode_attention(q, k_cache, v_cache, meta([0, 4], 3), 1.0, out)
    with pytest.raises(ValueError, match="longer than its block table"):
        cpu_native.decode_attention(q, k_cache, v_cache, meta([0, 1], 5), 1.0, out)
    assert torch.equal(out, torch.zeros(1, 2, 8))
    k = torch.randn(2, 1, 8)
    with pytest.raises(ValueError, match="slot outside 0..7"):
        cpu_native.store_kv(k, k, k_cache, v_cache, torch.tensor([3, 8]))
    assert not k_cache.any()


# --- a decode layer's attention half in one call ----------------------------------------------


def _decode_layer_ref(h, w, cos, sin, k_cache, v_cache, meta, eps, scale, nh, nkv, d, k, renorm):
    """The per-op PyTorch path of `AttentionModel` (torch backend) for one decode layer."""
    T = h.shape[0]
    x = rms_norm(h, w["input_norm"], eps)
    qkv = torch.nn.functional.linear(x, w["w_qkv"], w["b_qkv"]).view(T, nh + 2 * nkv, d)
    qk = qkv[:, : nh + nkv]
    if w["qk_head_norm"] is not None:
        qk = rms_norm(qk, None, eps) * w["qk_head_norm"]
    qk = AttentionModel.apply_rope(qk, (cos, sin))
    store_kv(qk[:, nh:], qkv[:, nh + nkv :], k_cache, v_cache, meta.slot_mapping)
    o = paged_attention_ref(qk[:, :nh].contiguous(), k_cache, v_cache, meta, scale)
    h = h + torch.nn.functional.linear(o.reshape(T, nh * d), w["o_proj"])
    x = rms_norm(h, w["post_norm"], eps)
    if w["router"] is None:
        return h, x, None, None
    probs = torch.nn.functional.linear(x, w["router"]).softmax(-1)
    weights, ids = probs.topk(k, dim=-1)
    if renorm:
        weights = weights / weights.sum(-1, keepdim=True)
    return h, x, ids, weights


def _decode_layer_weights(H, nh, nkv, d, E, bias, head_norm, g):
    r = lambda *s: torch.randn(*s, generator=g) / s[-1] ** 0.5  # noqa: E731
    return {
        "input_norm": 1 + 0.1 * torch.randn(H, generator=g),
        "post_norm": 1 + 0.1 * torch.randn(H, generator=g),
        "w_qkv": r((nh + 2 * nkv) * d, H),
        "b_qkv": 0.1 * torch.randn((nh + 2 * nkv) * d, generator=g) if bias else None,
        "qk_head_norm": 1 + 0.1 * torch.randn(nh + nkv, d, generator=g) if head_norm else None,
        "o_proj": r(H, nh * d),
        "router": r(E, H) if E else None,
    }


@pytest.mark.parametrize("nh,nkv,d,H", [(4, 2, 32, 128), (6, 2, 20, 72), (2, 2, 16, 40)])
@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize("bias,head_norm", [(False, True), (True, False)])
@pytest.mark.parametrize("E,k,renorm", [(16, 4, True), (60, 6, False), (0, 0, False)])
def test_decode_layer_matches_per_op_path(nh, nkv, d, H, T, bias, head_norm, E, k, renorm):
    """The one-call decode layer against the PyTorch per-op path: the residual stream, the normed
    MoE input, the routing, and the K/V written into the cache, for GQA shapes, head dims that
    are not multiples of the vector width, a router with E not a multiple of 16, dense layers."""
    g = torch.Generator().manual_seed(T * 100 + nh + E)
    block_size = 4
    seqs = [(int(torch.randint(0, 40, (1,), generator=g)), 1) for _ in range(T)]
    _, _, k_cache, v_cache, meta = _paged_batch(seqs, nh, nkv, d, block_size, g)
    w = _decode_layer_weights(H, nh, nkv, d, E, bias, head_norm, g)
    h = torch.randn(T, H, generator=g)
    cos, sin = _rope(meta.seq_lens - 1, d)
    eps, scale = 1e-6, d**-0.5
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    ref = _decode_layer_ref(h, w, cos, sin, kc_ref, vc_ref, meta, eps, scale, nh, nkv, d, k, renorm)
    layer = cpu_native.DecodeLayer(**w, num_heads=nh, num_kv_heads=nkv, head_dim=d, eps=eps,
                                   top_k=k, renormalize=renorm)  # fmt: skip
    h_out = h.clone()
    x, ids, weights = layer(h_out, cos, sin, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(h_out, ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x, ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache, kc_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_cache, vc_ref, rtol=1e-5, atol=1e-5)
    if E:
        assert torch.equal(ids, ref[2])
        torch.testing.assert_close(weights, ref[3], rtol=1e-5, atol=1e-6)
    else:
        assert ids is None and weights is None


def test_decode_layer_refuses_bad_input_before_writing():
    """Slots or block ids outside the cache, and rows that are not one token per sequence, are a
    ValueError before the residual stream or the cache is touched."""
    g = torch.Generator().manual_seed(0)
    nh, nkv, d, H = 2, 1, 8, 16
    _, _, k_cache, v_cache, meta = _paged_batch([(3, 1), (6, 1)], nh, nkv, d, 4, g)
    w = _decode_layer_weights(H, nh, nkv, d, 4, False, False, g)
    layer = cpu_native.DecodeLayer(**w, num_heads=nh, num_kv_heads=nkv, head_dim=d, eps=1e-6,
                                   top_k=2, renormalize=True)  # fmt: skip
    cos, sin = _rope(meta.seq_lens - 1, d)
    h = torch.randn(2, H, generator=g)
    kc, vc, h0 = k_cache.clone(), v_cache.clone(), h.clone()
    bad_slot = dataclasses.replace(
        meta, slot_mapping=torch.tensor([0, k_cache.numel()]), derived={}
    )
    with pytest.raises(ValueError, match="outside the cache"):
        layer(h, cos, sin, k_cache, v_cache, bad_slot, 1.0)
    tables = meta.block_tables.clone()
    tables[1, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match="outside the cache"):
        bad_table = dataclasses.replace(meta, block_tables=tables, derived={})
        layer(h, cos, sin, k_cache, v_cache, bad_table, 1.0)
    with pytest.raises(ValueError, match="one token per sequence"):
        layer(h[:1], cos[:1], sin[:1], k_cache, v_cache, meta, 1.0)
    assert torch.equal(h, h0) and torch.equal(k_cache, kc) and torch.equal(v_cache, vc)
    with pytest.raises(ValueError, match="w_qkv"):
        cpu_native.DecodeLayer(**{**w, "w_qkv": w["w_qkv"][:-1]}, num_heads=nh, num_kv_heads=nkv,
                               head_dim=d, eps=1e-6, top_k=2, renormalize=True)  # fmt: skip


# --- threads ------------------------------------------------------------------------------------


@pytest.fixture
def native_threads():
    """Sets the kernels' thread count for a test, back to one thread after it."""
    yield cpu_native.set_threads
    cpu_native.set_threads(1)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("tokens,skip", [(1, 0.0), (13, 0.5), (130, 0.0)])
def test_fused_moe_threads_change_no_bit(native_threads, threads, tokens, skip):
    """The experts run in parallel and each token's sum is then taken in ascending expert order:
    the result equals the one-thread one exactly, not only to rounding."""
    x, w13, w2, ids, w = _moe_case(tokens, 16, 72, 40, 4, skip, seed=tokens)
    layout = cpu_native.expert_layout(w13, w2)
    one = cpu_native.fused_moe(x, *layout, ids, w)
    native_threads(threads)
    for _ in range(20):  # the claiming of chunks differs from call to call
        assert torch.equal(cpu_native.fused_moe(x, *layout, ids, w), one)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("T", [3, 33, 70])
def test_decode_layer_threads_change_no_bit(native_threads, threads, T):
    """Rows split over threads: the residual stream, the MoE input, the routing and the K/V
    written equal the one-thread results exactly; bad input is still refused before writing."""
    g = torch.Generator().manual_seed(T)
    nh, nkv, d, H, E, k = 4, 2, 32, 128, 16, 4
    seqs = [(int(torch.randint(0, 60, (1,), generator=g)), 1) for _ in range(T)]
    _, _, k_cache, v_cache, meta = _paged_batch(seqs, nh, nkv, d, 4, g)
    w = _decode_layer_weights(H, nh, nkv, d, E, True, True, g)
    layer = cpu_native.DecodeLayer(**w, num_heads=nh, num_kv_heads=nkv, head_dim=d, eps=1e-6,
                                   top_k=k, renormalize=True)  # fmt: skip
    cos, sin = _rope(meta.seq_lens - 1, d)
    h = torch.randn(T, H, generator=g)

    def run():
        kc, vc, ho = k_cache.clone(), v_cache.clone(), h.clone()
        return (ho, *layer(ho, cos, sin, kc, vc, meta, d**-0.5), kc, vc)

    one = run()
    native_threads(threads)
    for _ in range(5):
        assert all(torch.equal(a, b) for a, b in zip(run(), one, strict=True))
    tables = meta.block_tables.clone()
    tables[-1, 0] = k_cache.shape[0]
    bad = dataclasses.replace(meta, block_tables=tables, derived={})
    h0, kc = h.clone(), k_cache.clone()
    with pytest.raises(ValueError, match="outside the cache"):
        layer(h, cos, sin, k_cache, v_cache, bad, 1.0)
    assert torch.equal(h, h0) and torch.equal(k_cache, kc)


# --- a whole decode step in one call ------------------------------------------------------------


@pytest.mark.parametrize("T", [0, 1, 5, 33])
@pytest.mark.parametrize("H,V", [(128, 512), (40, 67), (16, 3)])
def test_lm_head_matches_linear(T, H, V, native_threads):
    """4 x 4 tiles of 16-lane dot products: batches, vocabularies and hidden sizes that are not
    multiples of them; every thread count gives the same bits."""
    g = torch.Generator().manual_seed(T + H + V)
    x, w = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g)
    got = cpu_native.lm_head(x, w)
    assert got.shape == (T, V)
    torch.testing.assert_close(got, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)
    native_threads(3)
    assert torch.equal(cpu_native.lm_head(x, w), got)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.lm_head(x, w[:, 1:].contiguous())
    with pytest.raises(ValueError, match="contiguous"):
        cpu_native.lm_head(x, w.t())


def _decode_step_case(T, H, nh, nkv, d, E, k, I, V, L, g):
    """The layers, experts and globals of an L-layer MoE model, a paged pool [L, 2, ...] with
    random K/V everywhere, and a step of T one-token sequences over it."""
    seqs = [(int(torch.randint(0, 40, (1,), generator=g)), 1) for _ in range(T)]
    _, _, k_cache, _, meta = _paged_batch(seqs, nh, nkv, d, 4, g)
    pool = torch.randn(L, 2, *k_cache.shape, generator=g)
    layers, experts = [], []
    for _ in range(L):
        w = _decode_layer_weights(H, nh, nkv, d, E, False, True, g)
        layers.append(
            cpu_native.DecodeLayer(
                **w, num_heads=nh, num_kv_heads=nkv, head_dim=d, eps=1e-6, top_k=k, renormalize=True
            )  # fmt: skip
        )
        _, w13, w2, _, _ = _moe_case(1, E, H, I, k, 0.0, seed=len(experts))
        experts.append(cpu_native.expert_layout(w13, w2))
    embed = torch.randn(V, H, generator=g)
    final_norm = 1 + 0.1 * torch.randn(H, generator=g)
    lm_head = torch.randn(V, H, generator=g) / H**0.5
    ids = torch.randint(0, V, (T,), generator=g)
    cos, sin = _rope(meta.seq_lens - 1, d)
    step = cpu_native.DecodeStep(layers, experts, embed, final_norm, lm_head)
    return step, (layers, experts, embed, final_norm, lm_head), ids, cos, sin, pool, meta


def _decode_step_per_layer(parts, ids, cos, sin, pool, meta, scale):
    """The same step as the per-layer calls `AttentionModel.forward` makes, and its LM head."""
    layers, experts, embed, final_norm, lm_head = parts
    h = embed[ids]
    for i, (layer, (w13t, w2t)) in enumerate(zip(layers, experts)):
        x, top, weights = layer(h, cos, sin, pool[i, 0], pool[i, 1], meta, scale)
        h = h + cpu_native.fused_moe(x, w13t, w2t, top, weights)
    hn = cpu_native.rms_norm(h, final_norm, 1e-6)
    return hn, torch.nn.functional.linear(hn, lm_head)


@pytest.mark.parametrize(
    "H,nh,nkv,d,E,k,I,V",
    [(128, 4, 2, 32, 16, 4, 64, 512), (40, 2, 2, 16, 6, 2, 24, 67), (72, 6, 2, 20, 8, 3, 40, 130)],
)
@pytest.mark.parametrize("T", [1, 5, 33])
def test_decode_step_matches_per_layer_calls(T, H, nh, nkv, d, E, k, I, V):
    """The one-call decode step against the per-layer calls it replaces: every layer's K/V
    written into the pool bit for bit (so every layer's input was too), and the logits of its
    own LM head against ``F.linear`` to rounding, for hidden sizes and vocabularies that are not
    multiples of its 16-lane and 4 x 4 tiles, and batches that are not multiples of 4."""
    g = torch.Generator().manual_seed(T * 10 + H)
    step, parts, ids, cos, sin, pool, meta = _decode_step_case(T, H, nh, nkv, d, E, k, I, V, 3, g)
    pool_ref = pool.clone()
    hn, want = _decode_step_per_layer(parts, ids, cos, sin, pool_ref, meta, d**-0.5)
    got = step(ids, cos, sin, pool, meta, d**-0.5)
    assert torch.equal(pool, pool_ref)
    assert got.shape == (T, V) and got.dtype == torch.float32
    # the final hidden states were the per-layer calls' bit for bit: so are the logits of the
    # same LM head on them
    assert torch.equal(got, cpu_native.lm_head(hn, parts[4]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    exact = (hn.double() @ parts[4].double().T).float()
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [2, 3])
def test_decode_step_threads_change_no_bit(native_threads, threads):
    g = torch.Generator().manual_seed(threads)
    step, _, ids, cos, sin, pool, meta = _decode_step_case(37, 72, 6, 2, 20, 8, 3, 40, 130, 2, g)

    def run():
        p = pool.clone()
        return step(ids, cos, sin, p, meta, 0.2), p

    one = run()
    native_threads(threads)
    for _ in range(5):
        assert all(torch.equal(a, b) for a, b in zip(run(), one, strict=True))


def test_decode_step_refuses_bad_input_before_writing():
    """A token id outside the vocabulary, a block id outside the cache and rows that are not one
    token per sequence are a ValueError before the cache is touched; mismatched weights are
    refused when the step is built."""
    g = torch.Generator().manual_seed(0)
    step, parts, ids, cos, sin, pool, meta = _decode_step_case(4, 40, 2, 2, 16, 6, 2, 24, 67, 2, g)
    before = pool.clone()
    with pytest.raises(ValueError, match="token id outside 0..66"):
        step(torch.tensor([0, 1, 67, 2]), cos, sin, pool, meta, 0.25)
    tables = meta.block_tables.clone()
    tables[-1, 0] = pool.shape[2]
    with pytest.raises(ValueError, match="outside the cache"):
        step(ids, cos, sin, pool, dataclasses.replace(meta, block_tables=tables, derived={}), 0.25)
    with pytest.raises(ValueError, match="one per sequence"):
        step(ids[:3], cos, sin, pool, meta, 0.25)
    with pytest.raises(ValueError, match="kv_pool"):
        step(ids, cos, sin, pool[:1], meta, 0.25)
    assert torch.equal(pool, before)
    layers, experts, embed, final_norm, lm_head = parts
    with pytest.raises(ValueError, match="lm_head"):
        cpu_native.DecodeStep(layers, experts, embed, final_norm, lm_head[:, :-1])
    with pytest.raises(ValueError, match="one expert pair per layer"):
        cpu_native.DecodeStep(layers, experts[:1], embed, final_norm, lm_head)


def test_remote_decode_inputs_refuse_bad_arrays():
    """A remote decode micro-batch's arrays are read by address: a wrong dtype, a missing row or
    a strided view is refused by name before any call."""
    ids, pos = np.arange(3, dtype=np.int64), np.arange(3, dtype=np.int64)
    tables = np.zeros((3, 2), dtype=np.int32)
    assert len(cpu_native.DecodeInputs(ids, pos, tables)) == 3
    for bad, name in (
        ((ids.astype(np.int32), pos, tables), "token_ids"),
        ((ids, pos[:2], tables), "positions"),
        ((ids, pos, tables.astype(np.int64)), "block_tables"),
        ((ids, pos, np.zeros((3, 4), dtype=np.int32)[:, ::2]), "block_tables"),
    ):
        with pytest.raises(ValueError, match=name):
            cpu_native.DecodeInputs(*bad)
