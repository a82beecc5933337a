"""RoPE frequencies of a model: plain, or YaRN-scaled (``ModelConfig.rope_scaling``).

`rope_frequencies` gives the inverse frequencies ``[d/2]`` and the factor cos and sin are
multiplied by (YaRN's attention scaling), computed as transformers' ``_compute_yarn_parameters``
does. (GPT-OSS's YaRN, without an mscale pair; DeepSeek's variant with ``mscale`` /
``mscale_all_dim`` is issue 29a's to add here.)
"""

from __future__ import annotations

import math

import torch


def rope_frequencies(
    head_dim: int, theta: float, scaling: tuple, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim/2] float32, attention_factor)``."""
    d = head_dim
    pos_freqs = theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    if not scaling:
        return 1.0 / pos_freqs, 1.0
    kind, factor, orig, beta_fast, beta_slow, truncate, attention_factor = scaling
    assert kind == "yarn", kind
    if factor is None:
        factor = max_position_embeddings / orig
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations: float) -> float:
        return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # weight of the unscaled frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)
