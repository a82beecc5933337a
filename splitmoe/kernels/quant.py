"""Weights kept in their released quantized layout: `QuantizedWeight`, and the float32
dequantization every kernel is checked against.

Two formats, as released:

* ``"fp8"`` (DeepSeek-V3/R1, Kimi-K2, MiniMax-M2, Qwen3 FP8): ``data [..., N, K]``
  ``float8_e4m3fn`` and ``scale [..., ceil(N / bn), ceil(K / bk)]`` float32, one multiplier
  (the checkpoint's ``weight_scale_inv``) per ``bn x bk`` block.
* ``"mxfp4"`` (GPT-OSS): ``data [..., N, K // 2]`` uint8, two e2m1 codes a byte (element ``2j``
  in the low nibble of byte ``j``, ``2j + 1`` in the high one; `FP4_VALUES`), and ``scale
  [..., N, K // 32]`` uint8 e8m0 exponents: each group of 32 values is multiplied by
  ``2 ** (s - 127)``.

Stacked routed experts keep the runtime's canonical form: ``w13`` logical ``[E, 2I, H]`` (gate
rows, then up rows) and ``w2`` ``[E, H, I]``. The math is always: dequantize to float32 exactly
(an fp8 value times its block's scale, an fp4 value times its power of two), cast to the run
dtype, then the same GEMM as with dense weights; in float32 that is bit for bit what
dequantizing at load computed.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import torch

FORMATS = ("fp8", "mxfp4")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# e2m1 values of the 16 FP4 codes (transformers' integrations/mxfp4.py FP4_VALUES)
FP4_VALUES = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
MXFP4_GROUP = 32  # values sharing one scale

# byte -> its two values, low nibble first: one lookup per byte instead of two nibble masks
_FP4_PAIRS = torch.tensor([[FP4_VALUES[b & 0x0F], FP4_VALUES[b >> 4]] for b in range(256)])


def fp8_block_scales(scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """``scale [..., ceil(n / bn), ceil(k / bk)]`` repeated to one float32 multiplier per
    element ``[..., n, k]``."""
    bn, bk = block
    s = scale.float().repeat_interleave(bn, -2)[..., :n, :]
    return s.repeat_interleave(bk, -1)[..., :k]


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``data [..., N, K]`` float8 times its per-block ``scale [..., ceil(N / bn), ceil(K / bk)]``
    (DeepSeek-V3's ``weight_dequant``) -> float32 ``[..., N, K]``."""
    N, K = data.shape[-2:]
    bn, bk = block
    want = (*data.shape[:-2], -(-N // bn), -(-K // bk))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"fp8 scale of shape {tuple(scale.shape)} does not fit a {tuple(data.shape)} weight "
            f"in {bn}x{bk} blocks (expected {want})"
        )
    return data.float() * fp8_block_scales(scale, N, K, block)


def dequantize_mxfp4(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``data [..., N, K // 2]`` uint8 (two e2m1 codes a byte, low nibble first) and ``scale
    [..., N, K // 32]`` uint8 e8m0 -> float32 ``[..., N, K]`` (transformers'
    ``_convert_moe_packed_tensors`` before its transpose)."""
    *lead, N, half = data.shape
    G = scale.shape[-1]
    if tuple(scale.shape) != (*lead, N, half * 2 // MXFP4_GROUP) or half % (MXFP4_GROUP // 2):
        raise ValueError(
            f"mxfp4 scale of shape {tuple(scale.shape)} does not fit data {tuple(data.shape)} "
            f"({MXFP4_GROUP} values, {MXFP4_GROUP // 2} bytes, per scale)"
        )
    vals = _FP4_PAIRS.to(data.device)[data.to(torch.int64)]  # [..., N, K / 2, 2]
    vals = vals.view(*lead, N, G, MXFP4_GROUP)
    exp = scale.to(torch.int32) - 127
    return torch.ldexp(vals, exp[..., None]).view(*lead, N, G * MXFP4_GROUP)


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight (or a stack of them along leading dims) in its released quantized layout; see
    the module doc for ``data`` and ``scale`` per ``fmt``. ``block``: ``(bn, bk)`` for fp8,
    ``(1, 32)`` for mxfp4. `shape` is the logical ``[..., N, K]``."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    block: tuple[int, int]

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"QuantizedWeight: format {self.fmt!r} is not one of {FORMATS}")
        if self.data.dim() < 2 or self.scale.dim() != self.data.dim():
            raise ValueError(
                f"QuantizedWeight: data {tuple(self.data.shape)} and scale "
                f"{tuple(self.scale.shape)} must both be [..., rows, cols]"
            )
        N, K = self.shape[-2:]
        bn, bk = self.block
        if self.fmt == "fp8":
            want = (-(-N // bn), -(-K // bk))
            ok = self.data.dtype in FP8_DTYPES and self.scale.dtype == torch.float32
        else:
            want = (N, K // MXFP4_GROUP)
            ok = (
                self.data.dtype == torch.uint8
                and self.scale.dtype == torch.uint8
                and tuple(self.block) == (1, MXFP4_GROUP)
                and K % MXFP4_GROUP == 0
            )
        if not ok or tuple(self.scale.shape) != (*self.data.shape[:-2], *want):
            raise ValueError(
                f"QuantizedWeight({self.fmt}, block {tuple(self.block)}): data "
                f"{tuple(self.data.shape)} {self.data.dtype} and scale {tuple(self.scale.shape)} "
                f"{self.scale.dtype} do not fit (scale should be [..., {want[0]}, {want[1]}])"
            )

    @property
    def shape(self) -> torch.Size:
        """Logical shape ``[..., N, K]``."""
        if self.fmt == "mxfp4":
            return torch.Size((*self.data.shape[:-1], self.data.shape[-1] * 2))
        return self.data.shape

    def dim(self) -> int:
        return self.data.dim()

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Resident bytes: data and scales."""
        return self.data.nbytes + self.scale.nbytes

    def to(self, device) -> QuantizedWeight:
        return QuantizedWeight(self.data.to(device), self.scale.to(device), self.fmt, self.block)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight ``[..., N, K]``: float32 exactly, then cast to ``dtype``."""
        if self.fmt == "fp8":
            w = dequantize_fp8(self.data, self.scale, self.block)
        else:
            w = dequantize_mxfp4(self.data, self.scale)
        return w.to(dtype)

    def expert(self, e: int) -> QuantizedWeight:
        """The weight of leading index ``e`` (one expert of a stack)."""
        return QuantizedWeight(self.data[e], self.scale[e], self.fmt, self.block)

    def select(self, idx: torch.Tensor) -> QuantizedWeight:
        """The weights of leading indices ``idx`` (``index_select`` along dim 0)."""
        data = _bytes(self.data).index_select(0, idx).view(self.data.dtype)
        return QuantizedWeight(data, self.scale.index_select(0, idx), self.fmt, self.block)

    def index_copy_(self, dim: int, idx: torch.Tensor, src: QuantizedWeight) -> QuantizedWeight:
        """In place, like ``Tensor.index_copy_`` along a leading ``dim`` (rebalances)."""
        if not isinstance(src, QuantizedWeight) or (src.fmt, src.block) != (self.fmt, self.block):
            raise ValueError(
                f"index_copy_: a {self.fmt} {tuple(self.block)} weight takes only the same "
                f"layout, got {src!r:.80}"
            )
        if dim < 0 or dim >= self.dim() - 2:
            raise ValueError(f"index_copy_: dim {dim} is not a leading (stack) dim")
        _bytes(self.data).index_copy_(dim, idx, _bytes(src.data))  # (no float8 index_copy_)
        self.scale.index_copy_(dim, idx, src.scale)
        return self

    def dequantize_into(self, out: torch.Tensor) -> torch.Tensor:
        """`dequantize` of a single ``[N, K]`` weight into ``out [N, K]`` (float32), without a
        temporary the size of the weight where the shape splits into whole blocks."""
        N, K = self.shape
        if self.fmt == "fp8":
            bn, bk = self.block
            if N % bn or K % bk:
                return torch.mul(self.data.float(), fp8_block_scales(self.scale, N, K, self.block),
                                 out=out)  # fmt: skip
            out.copy_(self.data)  # float8 -> float32 is exact
            blocks = out.view(N // bn, bn, K // bk, bk)
            blocks.mul_(self.scale[:, None, :, None])
            return out
        pairs = out.view(N * K // 2, 2)
        torch.index_select(
            _FP4_PAIRS.to(out.device), 0, self.data.reshape(-1).to(torch.int32), out=pairs
        )
        groups = out.view(N, K // MXFP4_GROUP, MXFP4_GROUP)
        torch.ldexp(groups, self.scale.to(torch.int32)[..., None] - 127, out=groups)
        return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as uint8 (one byte elements): torch lacks some index ops for float8."""
    return t.view(torch.uint8)


_BUFFERS = threading.local()


def dequantize_reused(w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """``w`` (one ``[N, K]`` weight) dequantized into a buffer this thread reuses for every
    weight of that shape, dtype and device: valid until the next call for the same shape. The
    CPU kernels call it one expert (or one linear) at a time, so memory stays at the released
    size plus one dense weight per shape."""
    bufs = getattr(_BUFFERS, "d", None)
    if bufs is None:
        bufs = _BUFFERS.d = {}
    shape = tuple(w.shape)
    key = (shape, w.device)
    f32 = bufs.get(key)
    if f32 is None:
        f32 = bufs[key] = torch.empty(shape, dtype=torch.float32, device=w.device)
    w.dequantize_into(f32)
    if dtype == torch.float32:
        return f32
    key = (shape, w.device, dtype)
    cast = bufs.get(key)
    if cast is None:
        cast = bufs[key] = torch.empty(shape, dtype=dtype, device=w.device)
    return cast.copy_(f32)


Weight = torch.Tensor | QuantizedWeight


def cat_rows(ws: list[Weight], dtype: torch.dtype) -> Weight:
    """Weights ``[N_i, K]`` stacked along rows (fused q/k/v or gate/up projections). Quantized
    ones stay quantized where they share one layout and every part but the last ends on a
    block boundary (then the scale rows stack too); otherwise the result is dense ``dtype``."""
    if all(isinstance(w, QuantizedWeight) for w in ws):
        fmt, block = ws[0].fmt, ws[0].block
        same = all((w.fmt, w.block, w.shape[1]) == (fmt, block, ws[0].shape[1]) for w in ws)
        if same and all(w.shape[0] % block[0] == 0 for w in ws[:-1]):
            data = torch.cat([w.data for w in ws])
            return QuantizedWeight(data, torch.cat([w.scale for w in ws]), fmt, block)
    return torch.cat([dense(w, dtype) for w in ws])


def permute_rows(w: Weight, perm: torch.Tensor, dtype: torch.dtype) -> Weight:
    """``w [N, K]`` with its rows reordered (``w[perm]``). A quantized weight stays quantized
    where every row stays in its block of ``bn`` rows (its scales then still apply: MLA's
    rotary rows, 64 of them inside one 128-row block) or has its own scale (MXFP4); otherwise
    the result is dense ``dtype``."""
    if not isinstance(w, QuantizedWeight):
        return w.index_select(0, perm)
    data = _bytes(w.data).index_select(0, perm).view(w.data.dtype)
    if w.fmt == "mxfp4":  # a scale per row
        return QuantizedWeight(data, w.scale.index_select(0, perm), w.fmt, w.block)
    bn = w.block[0]
    rows = torch.arange(len(perm), device=perm.device)
    if len(perm) == w.shape[0] and bool((perm // bn == rows // bn).all()):
        return QuantizedWeight(data, w.scale, w.fmt, w.block)
    return w.dequantize(dtype).index_select(0, perm)


def dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """``w`` as a dense ``dtype`` tensor (dequantized if it is a `QuantizedWeight`)."""
    return w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w


def held_bytes(objs) -> int:
    """Resident bytes of the tensors and `QuantizedWeight`s in ``objs`` (nested lists, tuples,
    dicts and dataclasses), each storage counted once: a tied LM head, or a view of a weight
    kept beside it, costs nothing more."""
    seen: set[tuple[str, int]] = set()
    total = 0

    def walk(o) -> None:
        nonlocal total
        if isinstance(o, QuantizedWeight):
            walk(o.data)
            walk(o.scale)
        elif isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            key = (str(o.device), st.data_ptr())
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            for f in dataclasses.fields(o):
                walk(getattr(o, f.name))

    walk(objs)
    return total
