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
"""

from __future__ import annotations

import json
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


def _arguments_text(arguments) -> str | None:
    """Arguments as JSON text of an object; a string holding one is accepted (small models
    write it so); anything else is not a call."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


class HermesToolParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse_call(self, body: str, tools: list[dict] | None) -> tuple[str, str] | None:
        try:
            call = json.loads(body)
        except (json.JSONDecodeError, RecursionError):
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
    _ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def parse_call(self, body: str, tools: list[dict] | None) -> tuple[str, str] | None:
        at = body.find("<arg_key>")
        name = (body if at == -1 else body[:at]).strip()
        if not name or "<" in name or "\n" in name:
            return None
        # The template writes string values as they are and others as JSON: a value declared a
        # string stays text; any other is JSON when it reads as JSON (numbers, lists, objects)
        strings = _string_params(tools, name)
        arguments = {}
        rest = "" if at == -1 else body[at:]
        for m in self._ARG.finditer(rest):
            key, value = m.group(1).strip(), m.group(2)
            if key in strings:
                arguments[key] = value
                continue
            try:
                arguments[key] = json.loads(value)
            except (json.JSONDecodeError, RecursionError):
                arguments[key] = value
        if self._ARG.sub("", rest).strip():  # (something besides key/value pairs)
            return None
        return name, json.dumps(arguments, ensure_ascii=False)


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
    first call (always, unless the text before it is only whitespace)."""

    def __init__(self, parser: ToolParser, tools: list[dict] | None = None):
        self.parser = parser
        self.tools = tools
        self.text = ""
        self.sent = 0  # characters of text already given out as content

    def feed(self, delta: str) -> str:
        self.text += delta
        until = self.parser.hold_from(self.text)
        if until <= self.sent:
            return ""
        out = self.text[self.sent : until]
        self.sent = until
        return out

    def finish(self) -> ToolCallResult:
        result = self.parser.parse(self.text, self.tools)
        sent = self.text[: self.sent]
        content = result.content or ""
        rest = content[len(sent) :] if content.startswith(sent) else content
        return ToolCallResult(rest or None, result.tool_calls)
