"""Per-request sampling settings, validated where they are built.

Every field is checked against the range the ranks can honour, because a value that passes here
reaches a rank process: a seed beyond 64 bits or a temperature of 1e-40 would kill the rank
(and the job) if it were not refused here. Ranges and semantics follow vLLM's `SamplingParams`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch

from splitmoe.kv_transfer import KVTransferParams

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes any unsigned 64-bit value
MIN_TEMPERATURE = 0.01  # smaller positive temperatures are raised to it (as vLLM does)
MAX_LOGIT_BIAS = 100.0  # biases are clamped to [-100, 100] (as OpenAI and vLLM do)
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _show(value) -> str:
    """``repr(value)`` cut short (a hostile value can be huge: ``repr`` of an int past 4300
    digits even raises)."""
    if _is_int(value) and value.bit_length() > 128:
        return f"<an integer of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _number(name: str, value, allowed: str) -> float:
    """``value`` as a finite float, else a ValueError naming the field and its range."""
    try:
        f = float(value) if _is_number(value) else math.nan
    except OverflowError:  # (an int beyond float's range)
        f = math.inf
    if not math.isfinite(f):
        raise ValueError(f"{name}={_show(value)} must be a finite number {allowed}")
    return f


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token and when to stop.

    temperature: 0 means greedy; otherwise logits are divided by it before sampling (values in
    (0, 0.01) are raised to 0.01). top_k: keep the k most likely tokens (-1: all). top_p: keep
    the smallest set of tokens whose probability reaches top_p (1.0: all). min_p: drop tokens
    whose probability is below ``min_p`` times the most likely one's (0: off). seed: a
    per-request random stream in [0, 2**64 - 1], so a seeded request gives the same tokens
    whatever batch or topology it runs in.

    repetition_penalty (> 0, 1: off): the logit of every token that appears in the prompt or
    the output so far is divided by it when positive, multiplied when negative.
    presence_penalty, frequency_penalty ([-2, 2], 0: off): subtracted from the logit of every
    token of the output so far, once (presence) or once per occurrence (frequency).
    logit_bias: ``{token id: bias}`` (str keys as OpenAI sends them accepted) added to the
    logits, each bias clamped to [-100, 100]; stored as sorted ``(token id, bias)`` pairs.
    These three and ``min_tokens`` change greedy requests too; logprobs stay those of the model.

    stop_token_ids / EOS end a request with ``finish_reason="stop"`` (the stop token is kept in
    ``token_ids``) unless ``ignore_eos`` (which only disables EOS). stop: strings that end a
    request where they first appear in the decoded output (matched by the front end; the text
    stops before the string and ``token_ids`` at the token that completed it). min_tokens
    (0 .. max_tokens): until that many tokens were generated, EOS and ``stop_token_ids`` cannot
    be sampled and stop strings do not end the request. logprobs: None, or return each output
    token's log-probability under the model (before any processing, temperature, top-k and
    top-p) and those of the ``logprobs`` most likely tokens (0: only the chosen one's).
    cache_salt: requests reuse each other's cached prompt blocks only when their salts are
    equal (or both None), so a tenant that sets its own salt never shares KV with another.
    json_schema: structured output: a JSON schema (a dict, or its JSON text; stored as canonical
    text) that the output must be an instance of: each step only the tokens the schema's
    grammar allows can be chosen (xgrammar, `splitmoe.attention_nodes.grammar`), and the request
    ends with ``finish_reason="stop"`` once the JSON is complete.
    kv_transfer_params: prefill-decode disaggregation (`splitmoe.kv_transfer.KVTransferParams`,
    or its dict as vLLM's clients send it): the router sets it; other requests leave it None.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    cache_salt: str | None = None
    json_schema: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    # derived: whether logits processors or penalties apply before the token is chosen (they
    # change a greedy request's argmax too). Stored, not a property: the sampler reads it for
    # every row of every step (a field read costs a fraction of a property call).
    adjusts_logits: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        put = object.__setattr__  # (frozen: normalised values are stored this way)
        if not _is_int(self.max_tokens):
            raise ValueError(f"max_tokens={_show(self.max_tokens)} must be an integer >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        t = _number("temperature", self.temperature, ">= 0 (0 = greedy)")
        if t < 0:
            raise ValueError(f"temperature={t} must be finite and >= 0 (0 = greedy)")
        put(self, "temperature", max(t, MIN_TEMPERATURE) if t > 0 else 0.0)
        if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={_show(self.top_k)} must be -1 (disabled) or an integer >= 1")
        top_p = _number("top_p", self.top_p, "in (0, 1]")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        put(self, "top_p", top_p)
        min_p = _number("min_p", self.min_p, "in [0, 1]")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1]")
        put(self, "min_p", min_p)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(
                f"seed={_show(self.seed)} must be None or an integer in [0, 2**64 - 1]"
            )
        rep = _number("repetition_penalty", self.repetition_penalty, "> 0 (1 = off)")
        if rep <= 0:
            raise ValueError(f"repetition_penalty={rep} must be > 0 (1 = off)")
        put(self, "repetition_penalty", rep)
        for name in ("presence_penalty", "frequency_penalty"):
            v = _number(name, getattr(self, name), "in [-2, 2]")
            if not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name}={v} must be in [-2, 2] (0 = off)")
            put(self, name, v)
        put(self, "logit_bias", _logit_bias(self.logit_bias))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens={_show(self.min_tokens)} must be an integer in [0, max_tokens="
                f"{self.max_tokens}]"
            )
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise ValueError(f"stop_token_ids={_show(self.stop_token_ids)} must be a list of ints")
        stop = tuple(self.stop_token_ids or ())
        if any(not _is_int(t) or t < 0 for t in stop):
            raise ValueError(
                f"stop_token_ids={_show(self.stop_token_ids)} must be non-negative ints"
            )
        put(self, "stop_token_ids", stop)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={_show(self.ignore_eos)} must be True or False")
        if not isinstance(self.stop, (str, list, tuple, type(None))):
            raise ValueError(f"stop={_show(self.stop)} must be a string or a list of strings")
        strings = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(x, str) or not x for x in strings):
            raise ValueError(f"stop={_show(self.stop)} must be non-empty strings")
        put(self, "stop", strings)
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20
        ):
            raise ValueError(
                f"logprobs={_show(self.logprobs)} must be None or an integer in [0, 20]"
            )
        put(self, "json_schema", _json_schema(self.json_schema))
        put(self, "kv_transfer_params", KVTransferParams.parse(self.kv_transfer_params))
        adjusts = bool(
            self.json_schema is not None
            or self.min_tokens
            or self.logit_bias
            or self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
        )
        put(self, "adjusts_logits", adjusts)
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= 256):
            raise ValueError("cache_salt must be None or a string of 1 to 256 characters")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @cached_property
    def logit_bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``logit_bias`` as token ids (int64 ``[K]``) and biases (float32 ``[K]``), CPU
        tensors built on first use (on the rank; not a field: neither compared nor sent) and
        kept: the sampler adds every row's biases in one operation per step
        (`sampler.add_logit_bias`), no list built per row and step."""
        ids = torch.tensor([t for t, _ in self.logit_bias], dtype=torch.int64)
        biases = torch.tensor([b for _, b in self.logit_bias], dtype=torch.float32)
        return ids, biases

    @property
    def filters(self) -> bool:
        """Whether a sampled row's support is cut (``min_p``, ``top_k``, ``top_p``)."""
        return self.min_p > 0.0 or self.top_k > 0 or self.top_p < 1.0

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})")
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(
                f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
            )

    @classmethod
    def from_dict(cls, d: dict, where: str = "") -> SamplingParams:
        """From a dict of fields (a prompts file's line, or another's ``__dict__``: derived
        fields in it are recomputed, not taken)."""
        fields = {name for name, f in cls.__dataclass_fields__.items() if f.init}
        derived = set(cls.__dataclass_fields__) - fields
        derived |= {n for n, v in vars(cls).items() if isinstance(v, cached_property)}
        unknown = set(d) - fields - derived
        if unknown:
            raise ValueError(
                f"{where}unknown sampling field(s) {sorted(unknown)}; known: {sorted(fields)}"
            )
        return cls(**{k: v for k, v in d.items() if k in fields})


def _json_schema(value) -> str | None:
    """A schema (dict or JSON text) as canonical JSON text; whether a grammar can be built from
    it is checked where the request enters (`grammar.check_json_schema`)."""
    if value is None:
        return None
    try:
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, Mapping):
            raise ValueError(f"json_schema={_show(value)} must be a JSON object (a schema)")
        # (key order kept: the grammar writes an object's properties in the schema's order)
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except RecursionError:
        raise ValueError("json_schema is nested too deeply") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"json_schema is not a JSON object: {e}") from None


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` (int or decimal-string keys), or ``(token id, bias)`` pairs, as
    sorted pairs with each bias clamped to [-100, 100]."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 for p in value
    ):
        pairs = [tuple(p) for p in value]
    else:
        raise ValueError(
            f"logit_bias={_show(value)} must be a dict {{token id: bias in [-100, 100]}}"
        )
    out: dict[int, float] = {}
    for key, bias in pairs:
        token = key
        if isinstance(key, str) and key.isascii() and key.isdecimal() and len(key) <= 19:
            token = int(key)
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias key {_show(key)} must be a token id (an integer >= 0)")
        if token in out:
            raise ValueError(f"logit_bias names token id {token} twice")
        b = _number(f"logit_bias[{token}]", bias, "(clamped to [-100, 100])")
        out[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, b))
    return tuple(sorted(out.items()))
