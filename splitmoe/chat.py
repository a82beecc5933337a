"""Chat messages -> prompt text through the checkpoint's chat template, rendered as HF
transformers renders it (``apply_chat_template``): the Jinja2 template of
``tokenizer_config.json`` (or ``chat_template.jinja`` beside it) in a sandboxed environment with
``trim_blocks`` and ``lstrip_blocks``, the ``tojson`` filter that does not escape HTML, the
``raise_exception`` and ``strftime_now`` globals, and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...) as variables."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")


class ChatTemplateError(ValueError):
    """The template rejected the messages (its ``raise_exception``) or failed to render."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                x,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ChatTemplate | None:
        """The checkpoint's template, or None when it has none."""
        path = Path(path)
        config: dict = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            config = json.loads(cfg_file.read_text())
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja_file = path / "chat_template.jinja"
        if not source and jinja_file.is_file():
            source = jinja_file.read_text()
        if not source:
            return None
        special = {}
        for key in _SPECIAL:
            value = config.get(key)
            if isinstance(value, dict):  # (an AddedToken's fields)
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        return cls(source, special)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        import jinja2

        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected the messages: {e}") from None
