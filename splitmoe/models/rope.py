"""Rotary position embedding parameters: the inverse frequencies and HF's cos/sin scale, for the
rope types HF transformers implements that splitmoe supports (``default``, ``linear``, ``yarn``).

``config.json`` names the type in ``rope_parameters`` (transformers 5) or ``rope_scaling``
(older checkpoints, e.g. DeepSeek-V3's ``{"type": "yarn", "factor": 40, ...}``); `parse_rope`
turns either into `ModelConfig` fields, and rejects any other type by name before a rank starts.
YaRN (`yarn_inv_freq`) follows HF's ``_compute_yarn_parameters``; its ``mscale_all_dim``
correction of DeepSeek's softmax scale is `yarn_softmax_scale`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "yarn")
# Types that change nothing here: HF's "default" under other spellings.
_DEFAULT_ALIASES = (None, "default")


def parse_rope(raw: dict[str, Any], cfg_file: Path | str) -> dict[str, Any]:
    """``rope_theta``, ``rope_type`` and ``rope_scaling`` (the type's parameters as sorted
    ``(key, value)`` pairs) of a raw ``config.json``; an unsupported type is a ValueError naming
    it."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None)
    rope.pop("type", None)
    if rope_type in _DEFAULT_ALIASES:
        rope_type = "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{cfg_file}: rope type {rope_type!r} is not supported; splitmoe implements "
            f"{', '.join(ROPE_TYPES)}"
        )
    theta = float(rope.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    if rope_type == "linear" and not rope.get("factor"):
        raise ValueError(f"{cfg_file}: linear rope scaling needs a 'factor'")
    if rope_type == "yarn":
        if rope.get("factor") is None and not rope.get("original_max_position_embeddings"):
            raise ValueError(
                f"{cfg_file}: yarn rope scaling needs 'factor' or "
                "'original_max_position_embeddings'"
            )
        rope.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    return dict(
        rope_theta=theta,
        rope_type=rope_type,
        rope_scaling=tuple(sorted((k, v) for k, v in rope.items() if not isinstance(v, list))),
    )


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(cfg, dim: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim / 2] float32, attention_factor)`` of ``cfg`` (a `ModelConfig`) for a
    rotary dimension ``dim``: HF's ``ROPE_INIT_FUNCTIONS``; cos and sin are multiplied by
    ``attention_factor``."""
    p = dict(cfg.rope_scaling)
    base = cfg.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    if cfg.rope_type == "default":
        return 1.0 / (base**exponents), 1.0
    if cfg.rope_type == "linear":
        return 1.0 / (base**exponents) / float(p["factor"]), 1.0
    return yarn_inv_freq(p, dim, base, cfg.max_position_embeddings, device)


def _yarn_factor(p: dict[str, Any], max_pos: int) -> float:
    factor = p.get("factor")
    return max_pos / p["original_max_position_embeddings"] if factor is None else float(factor)


def yarn_inv_freq(
    p: dict[str, Any], dim: int, base: float, max_pos: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, float]:
    """HF's ``_compute_yarn_parameters``: interpolated low frequencies, extrapolated high ones,
    a linear ramp between; the cos/sin factor from ``mscale`` / ``mscale_all_dim``."""
    factor = _yarn_factor(p, max_pos)
    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
        else:
            attention_factor = _mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1
    orig = p["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = (1 - ramp).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def yarn_softmax_scale(cfg, scale: float) -> float:
    """DeepSeek's softmax scale: ``scale * mscale(factor, mscale_all_dim) ** 2`` under a scaled
    rope with ``mscale_all_dim`` (HF's ``yarn_apply_mscale``), else ``scale``."""
    p = dict(cfg.rope_scaling)
    if cfg.rope_type != "default" and p.get("mscale_all_dim"):
        factor = p.get("factor")
        if factor is None:
            factor = _yarn_factor(p, cfg.max_position_embeddings)
        m = _mscale(float(factor), p["mscale_all_dim"])
        scale = scale * m * m
    return scale
