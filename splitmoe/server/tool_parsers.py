"""Tool calls out of a chat model's text (the server's ``--tool-call-parser``).

A parser turns the generated text into OpenAI's ``message.content`` and ``message.tool_calls``
(each ``{"id": "call_<hex>", "type": "function", "function": {"name", "arguments"}}``, the
arguments as JSON text). A block it cannot read stays in the content as written: a parser
never raises on model output. Parsers, by the name vLLM gives them:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or several
  (Hermes 2 Pro/3, Qwen2.5, Qwen3, QwQ templates).
* ``glm45``: ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``
  (GLM-4.5, GLM-4.6 templates).

Streaming: ``ToolCallStream`` passes content through as it comes and holds text back from the
first place a call may start; at the end it parses what it held.

Model output is as hostile as a client's body (a prompt can make a model write anything): every
parser here is linear in its input (tags found with ``str.find`` from where the last one ended,
never a regex of lazy groups that backtracks over unclosed tags: one for glm45 takes seconds
on 10 KB of ``<arg_key>k</arg_key><arg_value>`` repeated, and grows with the cube), a stream's work
per chunk is amortized constant, and the JSON read is strict (no NaN, no number past float's
range; nesting past the interpreter's recursion limit is not a call).
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass, field


def new_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ToolCallResult:
    """``content``: the text outside the calls, None when it is empty or only whitespace.
    ``tool_calls``: OpenAI tool-call objects, in the order the model wrote them."""

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)


class ToolParser:
    """Base: ``start`` is the text that opens a call; ``parse_call`` reads one call's body."""

    name: str = ""
    start: str = ""
    end: str = ""

    def parse_call(self, body: str, tools: list[dict] | None) -> tuple[str, str] | None:
        """``(name, arguments as JSON text)`` from the text between ``start`` and ``end``, or
        None when it is not a call in this format."""
        raise NotImplementedError

    def parse(self, text: str, tools: list[dict] | None = None) -> ToolCallResult:
        """The whole generated text -> content and tool calls. A final call without its ``end``
        (the model stopped right after it) counts when its body reads. ``tools``: the request's
        OpenAI tool objects, for formats whose argument values need the declared types."""
        calls, content, pos = [], [], 0
        while (at := text.find(self.start, pos)) != -1:
            body_at = at + len(self.start)
            close = text.find(self.end, body_at)
            stop = len(text) if close == -1 else close + len(self.end)
            body = text[body_at : len(text) if close == -1 else close]
            call = self.parse_call(body, tools)
            content.append(text[pos:at])
            if call is None:
                content.append(text[at:stop])
            else:
                name, arguments = call
                calls.append(
                    {
                        "id": new_tool_call_id(),
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }
                )
            pos = stop
        content.append(text[pos:])
        joined = "".join(content)
        if not calls:
            return ToolCallResult(text if text.strip() else None, [])
        return ToolCallResult(joined if joined.strip() else None, calls)

    def hold_from(self, text: str) -> int:
        """Where text that may belong to a call begins: the first ``start``, or a tail of
        ``text`` that ``start`` begins with; ``len(text)`` when there is none. Text before it
        is content whatever follows."""
        at = text.find(self.start)
        if at != -1:
            return at
        for n in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-n:]):
                return len(text) - n
        return len(text)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (math.inf, -math.inf):
        raise ValueError(f"{text} is past float's range")
    return value


def _loads(text: str):
    """Strict JSON out of model output: ValueError (JSONDecodeError, an integer of more than
    4300 digits, NaN or a number past float's range) or RecursionError (nesting past the
    interpreter's limit, found in time linear in the text) when it is not."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite)


def _dumps(value) -> str | None:
    """JSON text of a value `_loads` gave (None where it cannot be written back)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None


def _arguments_text(arguments) -> str | None:
    """Arguments as JSON text of an object; a string holding one is accepted (small models
    write it so); anything else is not a call."""
    if isinstance(arguments, str):
        try:
            arguments = _loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return _dumps(arguments)


class HermesToolParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse_call(self, body: str, tools: list[dict] | None) -> tuple[str, str] | None:
        try:
            call = _loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(call, dict):
            return None
        name = call.get("name")
        # ("parameters" is what some Hermes fine-tunes write; SGLang reads it too)
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(name, str) or not name:
            return None
        arguments = _arguments_text(arguments)
        if arguments is None:
            return None
        return name, arguments


class Glm45ToolParser(ToolParser):
    name = "glm45"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse_call(self, body: str, tools: list[dict] | None) -> tuple[str, str] | None:
        at = body.find(_KEY_OPEN)
        name = (body if at == -1 else body[:at]).strip()
        if not name or "<" in name or "\n" in name:
            return None
        pairs = [] if at == -1 else _arg_pairs(body, at)
        if pairs is None:  # (something besides key/value pairs)
            return None
        # The template writes string values as they are and others as JSON: a value declared a
        # string stays text; any other is JSON when it reads as JSON (numbers, lists, objects)
        strings = _string_params(tools, name)
        arguments = {}
        for key, value in pairs:
            if key in strings:
                arguments[key] = value
                continue
            try:
                arguments[key] = _loads(value)
            except (ValueError, RecursionError):
                arguments[key] = value
        text = _dumps(arguments)
        return None if text is None else (name, text)


_KEY_OPEN, _KEY_CLOSE = "<arg_key>", "</arg_key>"
_VALUE_OPEN, _VALUE_CLOSE = "<arg_value>", "</arg_value>"
_SPACE = re.compile(r"\s*")


def _arg_pairs(body: str, pos: int) -> list[tuple[str, str]] | None:
    """The ``<arg_key>K</arg_key> <arg_value>V</arg_value>`` pairs of ``body`` from ``pos``
    on, with only whitespace around them; None when anything else is there or a tag is not
    closed. One pass: each tag is looked for once, from where the one before it ended."""
    pairs = []
    while True:
        pos = _SPACE.match(body, pos).end()
        if pos == len(body):
            return pairs
        if not body.startswith(_KEY_OPEN, pos):
            return None
        key_end = body.find(_KEY_CLOSE, pos + len(_KEY_OPEN))
        if key_end == -1:
            return None
        key = body[pos + len(_KEY_OPEN) : key_end].strip()
        pos = _SPACE.match(body, key_end + len(_KEY_CLOSE)).end()
        if not body.startswith(_VALUE_OPEN, pos):
            return None
        value_end = body.find(_VALUE_CLOSE, pos + len(_VALUE_OPEN))
        if value_end == -1:
            return None
        pairs.append((key, body[pos + len(_VALUE_OPEN) : value_end]))
        pos = value_end + len(_VALUE_CLOSE)


def _string_params(tools: list[dict] | None, name: str) -> set[str]:
    """The parameters the request's tool ``name`` declares of JSON type string."""
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            params = function.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            if isinstance(props, dict):
                return {
                    k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"
                }
    return set()


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Glm45ToolParser.name: Glm45ToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``; ValueError naming the known ones otherwise."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown tool call parser {name!r}; known parsers: {', '.join(sorted(TOOL_PARSERS))}"
        )
    return cls()


class ToolCallStream:
    """One streamed choice's text through a parser. ``feed(delta)`` returns the content that
    can go to the client now; ``finish()`` returns the rest: the content not yet sent (None
    when there is none) and the tool calls. Content sent plus content returned by ``finish``
    is ``parser.parse(text).content`` whenever that content starts with the text before the
    first call (always, unless the text before it is only whitespace).

    ``feed`` looks only at the delta and the few characters held before it (less than
    ``parser.start``), and keeps the deltas in a list: a stream of n characters costs O(n) in
    all, however small its chunks (searching and growing the whole text at every chunk was
    quadratic)."""

    def __init__(self, parser: ToolParser, tools: list[dict] | None = None):
        self.parser = parser
        self.tools = tools
        self._parts: list[str] = []
        self._tail = ""  # text after what was sent: a possible beginning of ``parser.start``
        self._holding = False  # a call started: everything from there waits for `finish`
        self.sent = 0  # characters of text already given out as content

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def feed(self, delta: str) -> str:
        self._parts.append(delta)
        if self._holding:
            return ""
        tail = self._tail + delta
        until = self.parser.hold_from(tail)
        self._tail = tail[until:]
        self._holding = self._tail.startswith(self.parser.start)
        self.sent += until
        return tail[:until]

    def finish(self) -> ToolCallResult:
        text = self.text
        result = self.parser.parse(text, self.tools)
        sent = text[: self.sent]
        content = result.content or ""
        rest = content[len(sent) :] if content.startswith(sent) else content
        return ToolCallResult(rest or None, result.tool_calls)
