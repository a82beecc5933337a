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
``w2 [n, H, I]``, reading only the listed experts' rows (``safe_open(...).get_slice``), and MXFP4
is dequantized at load (no kernel here reads FP4).
"""

from __future__ import annotations

import torch

# e2m1 values of the 16 FP4 codes (transformers' integrations/mxfp4.py FP4_VALUES)
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
MXFP4_GROUP = 32  # values sharing one scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> float32 ``[..., G * 32]``
    (transformers' ``_convert_moe_packed_tensors`` before its transpose)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    vals = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], -1)  # [..., G, 16, 2]
    vals = vals.flatten(-2)  # [..., G, 32]: low nibble first
    exp = scales.to(torch.int32) - 127
    return torch.ldexp(vals, exp[..., None]).flatten(-2)


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
) -> dict[int, tuple[torch.Tensor, ...]]:
    """The listed experts of each layer as ``(w13 [n, 2I, H], w2 [n, H, I], b13 [n, 2I],
    b2 [n, H])``, gate rows then up rows (the contract of `loader.load_expert_weights`)."""
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    out = {}
    for layer, listed in per_layer.items():
        p = f"model.layers.{layer}.mlp.experts"
        uniq = sorted(set(listed))
        if cfg.quantization == "mxfp4":
            gu = dequantize_mxfp4(
                reader.rows(f"{p}.gate_up_proj_blocks", uniq, (E, 2 * I, H // 32, 16)),
                reader.rows(f"{p}.gate_up_proj_scales", uniq, (E, 2 * I, H // 32)),
            )  # [n, 2I, H]
            w2 = dequantize_mxfp4(
                reader.rows(f"{p}.down_proj_blocks", uniq, (E, H, I // 32, 16)),
                reader.rows(f"{p}.down_proj_scales", uniq, (E, H, I // 32)),
            )  # [n, H, I]
        else:
            gu = reader.rows(f"{p}.gate_up_proj", uniq, (E, H, 2 * I)).transpose(1, 2)
            w2 = reader.rows(f"{p}.down_proj", uniq, (E, I, H)).transpose(1, 2)  # [n, H, I]
        bgu = reader.rows(f"{p}.gate_up_proj_bias", uniq, (E, 2 * I))  # [n, 2I] interleaved
        b2 = reader.rows(f"{p}.down_proj_bias", uniq, (E, H))  # [n, H]
        w13 = torch.cat([gu[:, 0::2], gu[:, 1::2]], 1)  # [n, 2I, H]: gate rows, then up rows
        b13 = torch.cat([bgu[:, 0::2], bgu[:, 1::2]], 1)  # [n, 2I]
        pos = {e: i for i, e in enumerate(uniq)}
        idx = torch.tensor([pos[e] for e in listed], dtype=torch.long)
        out[layer] = tuple(
            t.index_select(0, idx).to(device=device, dtype=dtype).contiguous()
            for t in (w13, w2, b13, b2)
        )
    return out
