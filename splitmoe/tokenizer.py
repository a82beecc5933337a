"""Text <-> token ids through a checkpoint's tokenizer: ``tokenizer.json`` (HF `tokenizers`), or
a tiktoken BPE file (``tiktoken.model``, Kimi-K2's released tokenizer) with the special tokens of
``tokenizer_config.json``.

`Tokenizer.from_checkpoint` picks the one the checkpoint ships; both answer `encode`, `decode`
and `decode_token` the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    """A checkpoint's tokenizer (`HFTokenizer` or `TiktokenTokenizer`)."""

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> Tokenizer | None:
        """``tokenizer.json`` where there is one, else ``tiktoken.model``; None without either."""
        root = Path(path)
        if (root / "tokenizer.json").is_file():
            return HFTokenizer.from_file(root / "tokenizer.json")
        if (root / TiktokenTokenizer.FILE).is_file():
            return TiktokenTokenizer.from_checkpoint(root)
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens``: let the tokenizer add what it adds
        (e.g. BOS); False for text that already has them, as a rendered chat prompt does."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens left out."""
        raise NotImplementedError

    def decode_token(self, token_id: int) -> str:
        """One token's own text (special tokens included): what log-probabilities name."""
        raise NotImplementedError


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` through HF `tokenizers`."""

    def __init__(self, tok: _HFTokenizer):
        self._tok = tok

    @classmethod
    def from_file(cls, f: Path) -> HFTokenizer:
        try:
            return cls(_HFTokenizer.from_file(str(f)))
        except Exception as e:
            raise ValueError(f"cannot load {f}: {e}") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decode_token(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)


class TiktokenTokenizer(Tokenizer):
    """Kimi-K2's tokenizer as released (its ``tokenization_kimi.py``, read here through the
    ``tiktoken`` package without running the checkpoint's code): byte-level BPE ranks in
    ``tiktoken.model`` (one ``base64(token) rank`` a line), Kimi's pre-split pattern (Han runs
    apart, cased words, 1-3 digits), and ``NUM_RESERVED + 2`` special ids after the base
    vocabulary, named by ``added_tokens_decoder`` of ``tokenizer_config.json`` (the rest
    ``<|reserved_token_{id}|>``). Special-token text in a prompt encodes as that special token,
    as Kimi's ``encode`` does; nothing is added around the text (Kimi adds no BOS)."""

    FILE = "tiktoken.model"
    NUM_RESERVED = 256
    PATTERN = "|".join(
        [
            r"""[\p{Han}]+""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
            r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
            r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    )
    # tiktoken's Rust core overflows its stack on very long runs of one character class
    # (openai/tiktoken#195): text goes in slices of at most this many such characters, as
    # Kimi's tokenizer and Llama 3's cut it
    MAX_RUN = 25_000

    def __init__(self, encoding, special_ids: frozenset[int]):
        self._enc = encoding
        self._special = special_ids

    @classmethod
    def from_checkpoint(cls, root: Path) -> TiktokenTokenizer:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        f = root / cls.FILE
        try:
            ranks = load_tiktoken_bpe(str(f))
        except Exception as e:
            raise ValueError(f"cannot load {f} (one 'base64-token rank' a line): {e}") from None
        cfg_file = root / "tokenizer_config.json"
        config = {}
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"cannot read {cfg_file}: {e}") from None
        named = {}
        for key, tok in (config.get("added_tokens_decoder") or {}).items():
            content = tok.get("content") if isinstance(tok, dict) else tok
            if not (str(key).isdigit() and isinstance(content, str)):
                raise ValueError(f"{cfg_file}: added_tokens_decoder entry {key!r} is malformed")
            named[int(key)] = content
        base = len(ranks)
        if any(i < base for i in named):
            raise ValueError(
                f"{cfg_file}: added tokens {sorted(i for i in named if i < base)[:5]} fall "
                f"inside the {base} BPE ranks of {f}"
            )
        end = max([base + cls.NUM_RESERVED + 2, *(i + 1 for i in named)])
        specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, end)}
        try:
            enc = tiktoken.Encoding(
                name=str(f), pat_str=cls.PATTERN, mergeable_ranks=ranks, special_tokens=specials
            )
        except Exception as e:
            raise ValueError(f"cannot build a tiktoken encoding from {f}: {e}") from None
        return cls(enc, frozenset(specials.values()))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        for piece in _runs_cut(text, self.MAX_RUN):
            ids += self._enc.encode(piece, allowed_special="all")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode([i for i in ids if i not in self._special])

    def decode_token(self, token_id: int) -> str:
        return self._enc.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")


def _runs_cut(text: str, max_run: int) -> Iterator[str]:
    """``text`` in slices, cut where a run of whitespace or of non-whitespace would pass
    ``max_run`` characters (short texts: one slice)."""
    if len(text) <= max_run:
        yield text
        return
    start = run = 0
    space = text[0].isspace()
    for i, ch in enumerate(text):
        if ch.isspace() != space:
            space, run = not space, 1
            continue
        run += 1
        if run > max_run:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]
