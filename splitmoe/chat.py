"""Chat messages -> prompt text -> prompt token ids through the checkpoint's chat template,
rendered as HF transformers renders it (``apply_chat_template``) and tokenized as vLLM does.

The template is the Jinja2 source of ``tokenizer_config.json`` (or ``chat_template.jinja`` beside
it, or the server's ``--chat-template``), run in an ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, the ``tojson`` filter that does not escape HTML, the
``raise_exception`` and ``strftime_now`` globals, HF's restricted ``dict`` and ``namespace``,
and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables.

The rendered text is tokenized *without* adding special tokens: a template that writes
``{{ bos_token }}`` (Llama 3, DeepSeek) already put BOS in the text, and the tokenizer's
post-processor adding another one is the double-BOS bug vLLM and SGLang fixed the same way.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitmoe.tokenizer import Tokenizer

_SPECIAL = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Variables the server sets itself: a request's ``chat_template_kwargs`` may not replace them
# (``messages``, ``tools`` and the two prompt flags have their own request fields; ``tokenize`` and
# ``chat_template`` are the ones vLLM refuses; the special tokens come from the checkpoint).
RESERVED_TEMPLATE_VARS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        *_SPECIAL,
    }
)

# Where the final message is cut with continue_final_message (HF appends this to its content and
# cuts the rendered text there, so whatever the template writes after the content is dropped).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "

# Names a message's reasoning is passed under (HF fills each from the others)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The request cannot be rendered: bad messages, flags or template variables, or the
    template rejected them (its ``raise_exception``) or failed on them. The message says which."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        import jinja2

        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ChatTemplate | None:
        """The checkpoint's template, or None when it has none."""
        path = Path(path)
        config = _tokenizer_config(path)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja_file = path / "chat_template.jinja"
        if not source and jinja_file.is_file():
            source = jinja_file.read_text()
        if not source:
            return None
        return cls(source, _special_tokens(config))

    @classmethod
    def from_file(cls, template: str | Path, checkpoint: str | Path | None = None) -> ChatTemplate:
        """The server's ``--chat-template``: the text of the file ``template`` (a ``.jinja``
        file), or, as vLLM does, ``template`` itself when no such file exists and it reads as a
        Jinja template (it has ``{``, ``}`` or a newline). The special tokens come from
        ``checkpoint``'s ``tokenizer_config.json`` when it has one."""
        text = str(template)
        path = Path(text).expanduser()
        try:
            is_file = path.is_file()
        except OSError:  # (a template string too long to be a path)
            is_file = False
        if is_file:
            try:
                source = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"cannot read the chat template file {str(path)!r}: {e}") from None
        elif any(c in text for c in "{}\n"):
            source = text
        else:
            raise ValueError(
                f"the chat template {text!r} is neither a readable file nor a Jinja template; "
                "give the path of a .jinja file or the template text itself"
            )
        if not source.strip():
            raise ValueError(f"the chat template {text!r} is empty")
        config = _tokenizer_config(Path(checkpoint)) if checkpoint is not None else {}
        return cls(source, _special_tokens(config))

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> str:
        """The prompt text for ``messages``, as HF's ``apply_chat_template(..., tokenize=False)``.

        ``add_generation_prompt``: end with the header that opens the assistant's reply.
        ``continue_final_message``: end exactly at the final message's content (nothing the
        template writes after it), so the model continues that message; exclusive with
        ``add_generation_prompt``. ``tools``: OpenAI tool objects, the template's ``tools``.
        ``chat_template_kwargs``: further template variables (e.g. Qwen3's ``enable_thinking``);
        names in ``RESERVED_TEMPLATE_VARS`` are refused. Raises ``ChatTemplateError``.
        """
        import jinja2

        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot both be true: set "
                "add_generation_prompt to false to continue the final message, or "
                "continue_final_message to false to start a new assistant message"
            )
        chat = _normalize_messages(messages)
        extra = _template_kwargs(chat_template_kwargs)
        if tools is not None and (
            not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
        ):
            raise ChatTemplateError("'tools' must be a list of tool objects")
        final = None
        if continue_final_message:
            final = chat[-1].get("content")
            if not isinstance(final, str):
                raise ChatTemplateError(
                    "continue_final_message is set but the final message has no text content "
                    "to continue"
                )
            if "content" not in self.source:
                raise ChatTemplateError(
                    "continue_final_message is set but this chat template does not read "
                    "messages' 'content'"
                )
            chat[-1]["content"] = final + _CONTINUE_TAG
        try:
            text = self._template.render(
                **self.special_tokens,
                **extra,
                messages=chat,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"the chat template tried an unsafe operation: {e}") from None
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected the messages: {e}") from None
        except Exception as e:  # (a template failing on input it did not expect: 'a' + 1, ...)
            raise ChatTemplateError(
                f"the chat template failed on these messages: {type(e).__name__}: {e}"
            ) from None
        if final is not None:
            text = _cut_at_continue_tag(text, final)
        return text

    def prompt_ids(
        self,
        tokenizer: Tokenizer,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        """The prompt's token ids: ``render(...)`` tokenized without adding special tokens (the
        template writes the ones the model wants), as HF's ``apply_chat_template(...,
        tokenize=True)`` and vLLM give them. Raises ``ChatTemplateError``."""
        text = self.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        return tokenizer.encode(text, add_special_tokens=False)


def _environment():
    """HF's template environment (transformers' ``_compile_jinja_template``)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    class TemplateDict:  # dict(...) in a template, without the type itself to climb from
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore attributes to climb from
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a namespace cannot hold the underscore attribute {name!r}"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def _tokenizer_config(path: Path) -> dict:
    f = path / "tokenizer_config.json"
    if not f.is_file():
        return {}
    try:
        config = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {f}: {e}") from None
    return config if isinstance(config, dict) else {}


def _special_tokens(config: dict) -> dict[str, str]:
    special = {}
    for key in _SPECIAL:
        value = config.get(key)
        if isinstance(value, dict):  # (an AddedToken's fields)
            value = value.get("content")
        if isinstance(value, str):
            special[key] = value
    return special


def _normalize_messages(messages) -> list[dict]:
    """A copy of ``messages`` as HF and vLLM hand them to the template: keys whose value is None
    dropped (templates render a missing key better than ``None``), reasoning under each of its
    names (HF), an assistant's tool-call ``arguments`` as objects rather than JSON text (vLLM:
    the tool-use templates expect dicts), an empty ``tool_calls`` dropped."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("'messages' must be a non-empty list of messages")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"message {i} must be an object, not {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        if m.get("role") == "assistant" and "tool_calls" in m:
            m["tool_calls"] = _tool_calls_for_template(i, m["tool_calls"])
            if not m["tool_calls"]:
                del m["tool_calls"]
        chat.append(m)
    return chat


def _tool_calls_for_template(i: int, tool_calls) -> list:
    if not isinstance(tool_calls, list):
        raise ChatTemplateError(f"message {i}: 'tool_calls' must be a list")
    out = []
    for call in tool_calls:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise ChatTemplateError(f"message {i}: each tool call must have a 'function' object")
        function = dict(call["function"])
        args = function.get("arguments")
        if not args:
            function["arguments"] = {}
        elif isinstance(args, str):
            try:
                function["arguments"] = json.loads(args)
            except RecursionError:  # (nested past the interpreter's limit: found in linear time)
                raise ChatTemplateError(
                    f"message {i}: a tool call's 'arguments' nests too deeply"
                ) from None
            except ValueError:  # (JSONDecodeError, or an integer of more than 4300 digits)
                raise ChatTemplateError(
                    f"message {i}: a tool call's 'arguments' is not JSON text: {args[:80]!r}"
                ) from None
        out.append({**call, "function": function})
    return out


def _template_kwargs(kwargs) -> dict:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ChatTemplateError("'chat_template_kwargs' must be an object")
    reserved = sorted(RESERVED_TEMPLATE_VARS & kwargs.keys())
    if reserved:
        raise ChatTemplateError(
            f"'chat_template_kwargs' cannot set {', '.join(reserved)}: the server sets these "
            "itself (use the request's own fields for messages, tools, add_generation_prompt "
            "and continue_final_message)"
        )
    return kwargs


def _cut_at_continue_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError(
            "continue_final_message is set but the chat template does not write the final "
            "message's content as given (it drops or changes part of it), so there is no place "
            "to continue from"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # (the template trimmed the content's trailing space)
