"""A smaller variant of the built-in default model, for fast tests that need no HF oracle."""

from __future__ import annotations

from pathlib import Path

from splitmoe.models.default_model import write_default_model

SMALL = dict(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=64,
)


def write_small_model(out: Path, **overrides) -> Path:
    return write_default_model(out, seed=1, **{**SMALL, **overrides})
