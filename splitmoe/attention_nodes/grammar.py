"""Structured output: JSON-schema grammars over a checkpoint's tokenizer, through xgrammar.

The flow of one request with a schema:

1. the front door checks the schema (`check_json_schema`, no tokenizer needed; the server runs
   it in a process of its own, within a time budget: `splitmoe.server.schema_check`): a bad
   schema is a 400 there, and what travels on is the schema's canonical JSON text
   (``response_format`` ``{"type": "json_object"}`` travels as `JSON_OBJECT_SCHEMA`);
2. the attention rank that owns the request makes a `GrammarState` with
   ``backend.state(schema)`` (`GrammarBackend`: one per rank, built from the checkpoint's
   ``tokenizer.json``; compiled grammars cached by schema text) on a thread beside its step
   loop: the request is scheduled once its grammar is ready, the others step meanwhile
   (xgrammar releases the GIL while it converts and compiles);
3. every step, before sampling, `apply_grammar_masks` sets to -inf each token a row's grammar
   does not allow now; after sampling, ``state.accept(token)`` advances the grammar;
4. the request stops when its state is `GrammarState.terminated` (the JSON is complete and only
   a stop token may follow) or when it samples a stop token, as any request does.

Whitespace: grammars are compiled with ``any_whitespace=False``: the only whitespace allowed is
the single space of json.dumps' separators (``{"a": 1, "b": [2, 3]}``). With free whitespace
a model, above all a small or random-weight one, can spend its whole budget on spaces and
newlines between two tokens of JSON. Strings and arrays without ``maxLength`` / ``maxItems``
can still run until ``max_tokens``; the schema bounds them, not this module.

Strict mode (xgrammar's default, as in vLLM): an object with ``properties`` allows no other keys
unless ``additionalProperties`` says so; properties come in the schema's order.

Only `tokenizers` reads the vocabulary here; HF `transformers` is not called (xgrammar itself
imports it, so it must be installed where xgrammar is). xgrammar, transformers with it, is
imported on first use: start-up time that ranks serving no structured request need not pay.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar

# response_format {"type": "json_object"}: any JSON object (keys and values free).
JSON_OBJECT_SCHEMA = '{"type":"object"}'

# Limits on a client's schema, checked before xgrammar sees it. xgrammar 0.2's conversion time
# grows about cubically with nesting (a few thousand levels do not finish), so nesting is
# capped; OpenAI's structured outputs allow 10 levels of objects, each two levels of JSON here
# ("properties", then the property's schema).
MAX_SCHEMA_DEPTH = 64  # levels of JSON nesting in the schema document
MAX_SCHEMA_CHARS = 128 * 1024  # of its canonical text

# Schema texts `check_json_schema` remembers as accepted (each at most MAX_SCHEMA_CHARS).
CHECKED_SCHEMAS = 64

# Compiled grammars kept per rank (least recently used evicted first). A compiled grammar's
# size grows with the vocabulary (its token-mask cache); both bounds hold at once.
GRAMMAR_CACHE_ENTRIES = 64
GRAMMAR_CACHE_BYTES = 256 * 2**20

# xgrammar's C++ errors start with "[hh:mm:ss] /path/to/file.cc:123: ": no source paths reach
# a client.
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


def _xgr():
    import xgrammar

    return xgrammar


def _xgr_message(e: BaseException) -> str:
    lines = [_XGR_PREFIX.sub("", ln).strip() for ln in str(e).strip().splitlines()]
    return " ".join(ln for ln in lines if ln) or type(e).__name__


def json_depth(value: object) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion, in time linear
    in its size."""
    depth, level = 0, [value]
    while level:
        nested = [v for v in level if isinstance(v, (dict, list))]
        if not nested:
            break
        depth += 1
        level = [c for v in nested for c in (v.values() if isinstance(v, dict) else v)]
    return depth


def check_json_schema(schema: str | dict) -> str:
    """Front-door check of a client's JSON schema; needs no tokenizer.

    Returns the schema as canonical JSON text (compact separators, key order kept: properties
    are generated in the order the schema lists them), the form `GrammarBackend.state` takes.
    Raises ValueError naming the problem: not JSON, not a JSON object, nested deeper than
    `MAX_SCHEMA_DEPTH`, longer than `MAX_SCHEMA_CHARS`, or a schema xgrammar cannot turn into a
    grammar (unknown type, dangling ``$ref``, ``minItems`` > ``maxItems``, a bad ``pattern``...).
    The last step can take long (xgrammar's conversion of a ``pattern`` grows with the square of
    a repetition count: ``[ab]{10000}`` takes seconds): the server bounds it in time.
    """
    text = canonical_schema(schema)
    if not _ACCEPTED.known(text):
        convert_schema(text)
        _ACCEPTED.add(text)
    return text


class _AcceptedSchemas:
    """The canonical texts this process knows to convert (least recently used out, at most
    `CHECKED_SCHEMAS`): a request's ``n`` sequences, or a client's repeated schema, convert
    once. The server's own checker adds those it accepted (`remember_accepted_schema`)."""

    def __init__(self, entries: int):
        self._texts: OrderedDict[str, None] = OrderedDict()
        self._entries = entries
        self._lock = threading.Lock()  # (front-end threads check at once)

    def known(self, text: str) -> bool:
        with self._lock:
            if text in self._texts:
                self._texts.move_to_end(text)
                return True
            return False

    def add(self, text: str) -> None:
        with self._lock:
            self._texts[text] = None
            while len(self._texts) > self._entries:
                self._texts.popitem(last=False)


_ACCEPTED = _AcceptedSchemas(CHECKED_SCHEMAS)


def remember_accepted_schema(text: str) -> None:
    """Records a canonical schema text that `convert_schema` accepted elsewhere (the server's
    checker process): `check_json_schema` in this process takes it without converting it."""
    _ACCEPTED.add(text)


def canonical_schema(schema: str | dict) -> str:
    """The checks of `check_json_schema` that need no xgrammar (quick: linear in the schema's
    size): its canonical text, or ValueError."""
    if isinstance(schema, str):
        try:
            value = json.loads(schema)
        except RecursionError:
            raise ValueError(f"schema nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
        except ValueError as e:
            raise ValueError(f"schema is not valid JSON: {e}") from None
    elif isinstance(schema, dict):
        value = schema
    else:
        raise ValueError(f"schema must be a JSON object or its text, not {type(schema).__name__}")
    if not isinstance(value, dict):
        raise ValueError(f"schema must be a JSON object, not a JSON {type(value).__name__}")
    if json_depth(value) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:  # a dict holding NaN, sets, objects...
        raise ValueError(f"schema is not valid JSON: {e}") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"schema is {len(text)} characters long; the limit is {MAX_SCHEMA_CHARS}")
    return text


def convert_schema(text: str) -> xgrammar.Grammar:
    """xgrammar's grammar of a canonical schema text; ValueError if it has none."""
    try:
        return _xgr().Grammar.from_json_schema(text, any_whitespace=False)
    except Exception as e:  # xgrammar raises RuntimeError and its own error types
        raise ValueError(f"unsupported JSON schema: {_xgr_message(e)}") from None


def _tokenizer_info(
    tokenizer_json: Path, vocab_size: int, stop_token_ids: tuple[int, ...]
) -> tuple[xgrammar.TokenizerInfo, list[bytes]]:
    """xgrammar's view of a ``tokenizer.json``, built as ``TokenizerInfo.from_huggingface``
    does for a fast tokenizer, from `tokenizers` alone, and each token's bytes (b"" where the
    token is never allowed).

    The vocabulary type (raw, byte-fallback, byte-level) and ``add_prefix_space`` come from the
    tokenizer.json's model, decoder and normalizer; where the vocabulary itself says otherwise
    (xgrammar's cross-check), the vocabulary wins. Ids at or above ``vocab_size`` are dropped (the
    model cannot produce them); ids the tokenizer lacks (a logits width padded past the
    vocabulary) and special added tokens other than the stop tokens are left empty, which
    xgrammar never allows: a special token written inside a JSON string would vanish when the
    output is decoded without special tokens; so are tokens holding control characters (below)."""
    from tokenizers import Tokenizer

    xgr = _xgr()
    text = tokenizer_json.read_text(encoding="utf-8")
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:
        raise ValueError(f"cannot load {tokenizer_json}: {e}") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    encoded: list[str] = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size:
            encoded[idx] = token
    for idx, added in tok.get_added_tokens_decoder().items():
        if added.special and idx < vocab_size and idx not in stop_token_ids:
            encoded[idx] = ""

    meta = xgr.TokenizerInfo._detect_metadata_from_hf(text)
    vocab_type, add_prefix_space = meta["vocab_type"], meta["add_prefix_space"]
    from_vocab = xgr.TokenizerInfo._detect_vocab_type_from_vocab(vocab)
    if from_vocab is not None and from_vocab != vocab_type:
        vocab_type = from_vocab
        first = tok.encode("a", add_special_tokens=False).tokens
        prefix = "▁" if vocab_type == xgr.VocabType.BYTE_FALLBACK else "Ġ"
        add_prefix_space = bool(first) and first[0].startswith(prefix)

    def info() -> xgrammar.TokenizerInfo:
        return xgr.TokenizerInfo(
            encoded,
            vocab_type,
            vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids),
            add_prefix_space=add_prefix_space,
        )

    # Bytes no JSON output may hold, which xgrammar 0.2 lets through; the tokens holding them are
    # removed from the vocabulary it sees. (1) Below 0x20: compact JSON (any_whitespace=False)
    # has no whitespace but " ", and a string's control characters must be escaped; strings with
    # maxLength / minLength admit them raw (xgrammar issue #800), and `json.loads` then fails.
    # (2) ED A0-BF: UTF-8 of a UTF-16 surrogate, not valid UTF-8 (decoded as U+FFFD each byte);
    # xgrammar's character classes admit it. The same pair split across two tokens is kept out
    # by `GrammarState` (``_lone_ed``).
    bad = re.compile(rb"[\x00-\x1f]|\xed[\xa0-\xbf]")
    decoded = info().decoded_vocab  # (slow for a large vocabulary: converted once, kept)
    for i, b in enumerate(decoded):
        if b and i not in stop_token_ids and (not encoded[i] or bad.search(b)):
            encoded[i], decoded[i] = "", b""
    return info(), decoded


class GrammarBackend:
    """One per attention rank: compiles JSON schemas against the model's vocabulary and hands out
    a `GrammarState` per request. Compiled grammars are cached by schema text, least recently
    used first out, at most `GRAMMAR_CACHE_ENTRIES` of them and `GRAMMAR_CACHE_BYTES` in all, so
    that clients sending ever new schemas cannot grow a rank's memory."""

    def __init__(
        self,
        tokenizer_info: xgrammar.TokenizerInfo,
        decoded_vocab: list[bytes],
        *,
        max_entries: int = GRAMMAR_CACHE_ENTRIES,
        max_bytes: int = GRAMMAR_CACHE_BYTES,
        compile_threads: int | None = None,
    ):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"cache bounds must be >= 1, got {max_entries} entries, {max_bytes} B")
        xgr = _xgr()
        self.vocab_size = tokenizer_info.vocab_size
        self.stop_token_ids = tuple(tokenizer_info.stop_token_ids)
        self.max_entries, self.max_bytes = max_entries, max_bytes
        # ``compile_threads``: xgrammar's threads per compile (None: one per core, up to 8).
        # xgrammar's own cache is off, ours bounds memory.
        if compile_threads is None:
            compile_threads = min(8, len(os.sched_getaffinity(0)))
        self._compiler = xgr.GrammarCompiler(
            tokenizer_info, max_threads=max(1, compile_threads), cache_enabled=False
        )
        self._cache: OrderedDict[str, xgrammar.CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        # What a terminated state allows: its stop tokens only.
        self._stop_row = _bit_row(self.stop_token_ids, self.vocab_size)  # [ceil(V / 32)] int32
        # After a token ending in the lead byte ED, the next byte must be 80-9F (A0-BF would make
        # a surrogate): the tokens that may follow such a token, and those that end in ED.
        self._after_ed_row = _bit_row(
            tuple(i for i, b in enumerate(decoded_vocab) if b and not 0xA0 <= b[0] <= 0xBF),
            self.vocab_size,
        )
        self._ends_in_ed = frozenset(i for i, b in enumerate(decoded_vocab) if b and b[-1] == 0xED)

    @classmethod
    def from_checkpoint(
        cls, path: str | os.PathLike, vocab_size: int, eos_token_ids: tuple[int, ...], **kw
    ) -> GrammarBackend:
        """From a checkpoint directory's ``tokenizer.json``. ``vocab_size`` is the logits width
        (config.json's, which may exceed the tokenizer's vocabulary: the extra ids are never
        allowed); ``eos_token_ids`` are the model's stop tokens, the only tokens allowed once
        the JSON is complete. Raises ValueError without a tokenizer.json."""
        f = Path(path) / "tokenizer.json"
        if not f.is_file():
            raise ValueError(f"structured output needs the tokenizer: {f} does not exist")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        eos = tuple(int(t) for t in eos_token_ids)
        if not eos:
            raise ValueError("structured output needs the model's EOS token ids; none given")
        bad = [t for t in eos if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"EOS token ids {bad} are outside the vocabulary [0, {vocab_size})")
        return cls(*_tokenizer_info(f, vocab_size, eos), **kw)

    def compile(self, schema: str) -> xgrammar.CompiledGrammar:
        """The compiled grammar of a schema's text (cached). ValueError if it is not a schema
        `check_json_schema` passes (its limits hold here too: a schema from the Python API
        reaches the rank without the front door) or xgrammar cannot compile it."""
        compiled = self._cache.get(schema)
        if compiled is not None:
            self._cache.move_to_end(schema)
            return compiled
        converted = convert_schema(canonical_schema(schema))
        try:
            compiled = self._compiler.compile_grammar(converted)
        except Exception as e:
            raise ValueError(f"unsupported JSON schema: {_xgr_message(e)}") from None
        self._cache[schema] = compiled
        self._cache_bytes += compiled.memory_size_bytes
        while len(self._cache) > 1 and (
            len(self._cache) > self.max_entries or self._cache_bytes > self.max_bytes
        ):
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.memory_size_bytes
        return compiled

    @property
    def cached_schemas(self) -> int:
        return len(self._cache)

    def state(self, schema: str) -> GrammarState:
        """A new request's grammar state for ``schema`` (canonical text from
        `check_json_schema`, or any schema text: it is checked again here, this being another
        edge). ValueError if it fails the check or cannot be compiled."""
        if not isinstance(schema, str):
            raise ValueError(f"schema must be JSON text, not {type(schema).__name__}")
        return GrammarState(self.compile(schema), self)


def _bit_row(token_ids: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    words = [0] * ((vocab_size + 31) // 32)
    for t in token_ids:
        words[t // 32] |= 1 << (t % 32)
    # int32 storage of uint32 words, as xgrammar's bitmask
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


class GrammarState:
    """One request's position in its grammar: which tokens may come next, advanced by each
    sampled token. Made by `GrammarBackend.state`."""

    def __init__(self, compiled: xgrammar.CompiledGrammar, backend: GrammarBackend):
        self._matcher = _xgr().GrammarMatcher(compiled)
        self._backend = backend
        self._terminated: bool | None = None  # computed on first ask after each accept
        self._lone_ed = False  # the output ends in the UTF-8 lead byte ED

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    def accept(self, token: int) -> None:
        """Advance past a sampled token. ValueError if the grammar does not allow it now (a
        token the mask let through is always allowed; one sampled from an unmasked or all-masked
        row may not be) or the state has terminated."""
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token {token} is outside the vocabulary [0, {self.vocab_size})")
        if not self._matcher.accept_token(int(token)):
            why = "the JSON is complete" if self.terminated else "the grammar does not allow it"
            raise ValueError(f"token {token} rejected: {why}")
        self._terminated = None
        self._lone_ed = token in self._backend._ends_in_ed

    @property
    def completed(self) -> bool:
        """The text so far is a complete JSON value of the schema (a stop token is allowed now,
        and perhaps more tokens: the digits of a top-level number may go on)."""
        return self._matcher.is_terminated() or self._matcher.is_completed()

    @property
    def terminated(self) -> bool:
        """The JSON is complete and nothing but a stop token may follow (or a stop token was
        accepted): the request should stop."""
        if self._terminated is None:
            m = self._matcher
            if m.is_terminated():
                self._terminated = True
            elif not m.is_completed():
                self._terminated = False
            else:
                xgr = _xgr()
                row = xgr.allocate_token_bitmask(1, self.vocab_size)
                m.fill_next_token_bitmask(row, 0)
                probe = torch.zeros(1, self.vocab_size)
                xgr.apply_token_bitmask_inplace(probe, row, vocab_size=self.vocab_size)
                probe[0, list(self._backend.stop_token_ids)] = float("-inf")
                self._terminated = not bool(torch.isfinite(probe).any())
        return self._terminated

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed-next-token bits into ``bitmask[row]`` (CPU int32 [B, ceil(V/32)],
        xgrammar's layout: bit ``t % 32`` of word ``t // 32`` set = token t allowed). A terminated
        state allows its stop tokens only."""
        if self._matcher.is_terminated():
            bitmask[row].copy_(self._backend._stop_row)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)
            if self._lone_ed:
                bitmask[row] &= self._backend._after_ed_row


def apply_grammar_masks(logits: torch.Tensor, states: list[GrammarState | None]) -> None:
    """In place on ``logits`` [B, V] float32 (any device): -inf for every token that row b's
    grammar does not allow now; rows whose state is None are untouched.

    V is the logits width every state was built for (`GrammarBackend`'s ``vocab_size``). The
    masks are filled on the CPU, one row per state, then moved to the logits' device and applied
    by xgrammar's kernel for that device."""
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} rows of states")
    rows = [b for b, s in enumerate(states) if s is not None]
    if not rows:
        return
    V = logits.shape[1]
    for b in rows:
        if states[b].vocab_size != V:
            raise ValueError(f"row {b}'s grammar is for {states[b].vocab_size} tokens, not {V}")
    xgr = _xgr()
    bitmask = xgr.allocate_token_bitmask(len(states), V)  # [B, ceil(V / 32)] int32, CPU
    for b in rows:
        states[b].fill_bitmask(bitmask, b)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=V, indices=rows)
