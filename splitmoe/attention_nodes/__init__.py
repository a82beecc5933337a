"""Attention ranks: the non-expert part of the model, the paged KV cache, sampling, and the
per-step worker that drives them."""
