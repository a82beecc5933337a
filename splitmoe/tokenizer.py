"""Text <-> token ids through a checkpoint's ``tokenizer.json`` (HF `tokenizers`)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, tok: _HFTokenizer):
        self._tok = tok

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> Tokenizer | None:
        f = Path(path) / "tokenizer.json"
        if not f.is_file():
            return None
        try:
            return cls(_HFTokenizer.from_file(str(f)))
        except Exception as e:
            raise ValueError(f"cannot load {f}: {e}") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens``: let the tokenizer's post-processor add
        what it adds (e.g. BOS); False for text that already has them, as a rendered chat
        prompt does."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decode_token(self, token_id: int) -> str:
        """One token's own text (special tokens included): what log-probabilities name."""
        return self._tok.decode([token_id], skip_special_tokens=False)
