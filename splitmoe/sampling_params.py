"""Per-request sampling settings, validated where they are built."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token and when to stop.

    temperature: 0 means greedy; otherwise logits are divided by it before sampling.
    top_k: keep the k most likely tokens (-1: all). top_p: keep the smallest set of tokens whose
    probability reaches top_p (1.0: all). seed: a per-request random stream, so a seeded request
    gives the same tokens whatever batch or topology it runs in. stop_token_ids / EOS end a request
    with ``finish_reason="stop"`` (the stop token is kept in ``token_ids``) unless ``ignore_eos``
    (which only disables EOS). stop: strings that end a request where they first appear in the
    decoded output (matched by the front end; the text stops before the string and
    ``token_ids`` at the token that completed it). logprobs: None, or return each output
    token's log-probability under the model (before temperature, top-k and top-p) and those of
    the ``logprobs`` most likely tokens (0: only the chosen one's). cache_salt: requests reuse
    each other's cached prompt blocks only when their salts are equal (or both None), so a tenant
    that sets its own salt never shares KV with another.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature):
            raise ValueError(f"temperature={self.temperature!r} must be a number >= 0")
        if self.temperature < 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature={self.temperature} must be finite and >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be -1 (disabled) or an integer >= 1")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed={self.seed!r} must be None or an integer >= 0")
        stop = tuple(self.stop_token_ids or ())
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be non-negative ints")
        object.__setattr__(self, "stop_token_ids", stop)
        strings = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(x, str) or not x for x in strings):
            raise ValueError(f"stop={self.stop!r} must be non-empty strings")
        object.__setattr__(self, "stop", strings)
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= 20
        ):
            raise ValueError(f"logprobs={self.logprobs!r} must be None or an integer in [0, 20]")
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= 256):
            raise ValueError("cache_salt must be None or a string of 1 to 256 characters")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})")

    @classmethod
    def from_dict(cls, d: dict, where: str = "") -> SamplingParams:
        fields = set(cls.__dataclass_fields__)
        unknown = set(d) - fields
        if unknown:
            raise ValueError(
                f"{where}unknown sampling field(s) {sorted(unknown)}; known: {sorted(fields)}"
            )
        d = dict(d)
        for key in ("stop_token_ids", "stop"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        return cls(**d)
