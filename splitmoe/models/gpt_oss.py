"""GPT-OSS specifics the runtime needs beyond its `families.GptOss` adapter: its fused (or MXFP4)
expert tensors.

Experts are stored one tensor per layer and projection, in the layout ``save_pretrained`` writes
(transformers 5.24): ``mlp.experts.gate_up_proj [E, H, 2I]`` (``x @ W``; gate and up columns
interleaved: gate ``0::2``, up ``1::2``), ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``,
``down_proj_bias [E, H]``. The released checkpoints hold the weights in MXFP4 instead
(``*_blocks [E, rows, cols / 32, 16]`` uint8, two FP4 (e2m1) values a byte, low nibble first;
``*_scales [E, rows, cols / 32]`` uint8, a power-of-two exponent biased by 127 per 32 values),
rows being the output features (``2I`` interleaved for gate_up, ``H`` for down). Both are
turned into the runtime's canonical ``w13 [n, 2I, H]`` (gate rows, then up rows) and
``w2 [n, H, I]``, reading only the listed experts' rows, one expert at a time into tensors
allocated once. MXFP4 stays MXFP4 (`QuantizedWeight`: data ``[n, rows, cols / 2]``, the blocks'
bytes in order, and scales ``[n, rows, cols / 32]``); only its rows are reordered.
"""

from __future__ import annotations

import torch

from splitmoe.kernels import quant
from splitmoe.kernels.quant import FP4_VALUES, MXFP4_GROUP, QuantizedWeight


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> float32 ``[..., G * 32]``
    (transformers' ``_convert_moe_packed_tensors`` before its transpose)."""
    return quant.dequantize_mxfp4(blocks.flatten(-2), scales)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., cols]`` (cols a multiple of 32) -> ``(blocks [..., cols/32, 16] uint8,
    scales [..., cols/32] uint8)``: each group of 32 scaled by the power of two that brings its
    largest magnitude to <= 6, then rounded to the nearest FP4 value. The inverse of
    `dequantize_mxfp4` up to that rounding (tests write MXFP4 checkpoints with it)."""
    *lead, cols = w.shape
    g = w.float().reshape(*lead, cols // MXFP4_GROUP, MXFP4_GROUP)
    amax = g.abs().amax(-1).clamp(min=2.0**-120)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # [..., G]
    scaled = g / torch.exp2(exp)[..., None]
    lut = torch.tensor(FP4_VALUES[:8])
    code = (scaled.abs()[..., None] - lut).abs().argmin(-1)  # [..., G, 32] nearest magnitude
    code = code + 8 * ((scaled < 0) & (code > 0))  # sign bit (no negative zero)
    code = code.to(torch.uint8).view(*lead, cols // MXFP4_GROUP, 16, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def load_experts(
    reader, cfg, per_layer: dict[int, list[int]], dtype: torch.dtype, device: str
) -> dict[int, tuple[torch.Tensor | QuantizedWeight, ...]]:
    """The listed experts of each layer as ``(w13 [n, 2I, H], w2 [n, H, I], b13 [n, 2I],
    b2 [n, H])``, gate rows then up rows (the contract of `loader.load_expert_weights`); with
    MXFP4, ``w13`` and ``w2`` are `QuantizedWeight`."""
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    mx = cfg.quantization == "mxfp4"
    out = {}
    for layer, listed in per_layer.items():
        p = f"model.layers.{layer}.mlp.experts"
        n = len(listed)
        if mx:
            w13 = _empty_mxfp4(n, 2 * I, H, device)
            w2 = _empty_mxfp4(n, H, I, device)
        else:
            w13 = torch.empty(n, 2 * I, H, dtype=dtype, device=device)
            w2 = torch.empty(n, H, I, dtype=dtype, device=device)
        b13 = torch.empty(n, 2 * I, dtype=dtype, device=device)
        b2 = torch.empty(n, H, dtype=dtype, device=device)
        held = (w13, w2, b13, b2)
        first: dict[int, int] = {}
        for slot, e in enumerate(listed):
            if e in first:  # a replica: copy the slot already read
                for t in _tensors(held):
                    t[slot].copy_(t[first[e]])
                continue
            first[e] = slot

            def one(name, shape, e=e, p=p):  # expert e's slice of a fused [E, ...] tensor
                return reader.rows(f"{p}.{name}", [e], (E, *shape))[0]

            if mx:
                G = MXFP4_GROUP
                gu = one("gate_up_proj_blocks", (2 * I, H // G, 16)).flatten(-2)  # [2I, H / 2]
                _deinterleave_into(w13.data[slot], gu)
                _deinterleave_into(w13.scale[slot], one("gate_up_proj_scales", (2 * I, H // G)))
                w2.data[slot].copy_(one("down_proj_blocks", (H, I // G, 16)).flatten(-2))
                w2.scale[slot].copy_(one("down_proj_scales", (H, I // G)))
            else:
                _deinterleave_into(w13[slot], one("gate_up_proj", (H, 2 * I)).t())  # [2I, H]
                w2[slot].copy_(one("down_proj", (I, H)).t())  # [H, I]
            _deinterleave_into(b13[slot], one("gate_up_proj_bias", (2 * I,)))
            b2[slot].copy_(one("down_proj_bias", (H,)))
        out[layer] = held
    return out


def _empty_mxfp4(n: int, rows: int, cols: int, device: str) -> QuantizedWeight:
    data = torch.empty(n, rows, cols // 2, dtype=torch.uint8, device=device)
    scale = torch.empty(n, rows, cols // MXFP4_GROUP, dtype=torch.uint8, device=device)
    return QuantizedWeight(data, scale, "mxfp4", (1, MXFP4_GROUP))


def _deinterleave_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``src [2I, ...]`` with gate and up rows interleaved (gate ``0::2``, up ``1::2``) into
    ``dst [2I, ...]`` as gate rows, then up rows."""
    inter = src.shape[0] // 2
    dst[:inter].copy_(src[0::2])
    dst[inter:].copy_(src[1::2])


def _tensors(held) -> list[torch.Tensor]:
    out = []
    for t in held:
        out += [t.data, t.scale] if isinstance(t, QuantizedWeight) else [t]
    return out
