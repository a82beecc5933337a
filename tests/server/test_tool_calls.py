"""Tool calls reach the client: a chat choice whose text holds Hermes ``<tool_call>`` blocks
comes back as OpenAI's ``message.tool_calls`` (``finish_reason`` "tool_calls"), whole or
streamed, through the server's own response code (`splitmoe.server.reply`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from splitmoe.outputs import RequestOutput
from splitmoe.sampling_params import SamplingParams
from splitmoe.server.protocol import Sampling
from splitmoe.server.reply import Reply, ToolCalls, tool_delta
from splitmoe.server.tool_parsers import get_tool_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
TEXT = (
    'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def _reply() -> Reply:
    state = SimpleNamespace(served_model_name="m", tokenizer=None)
    s = Sampling([SamplingParams()], 1, False, False, None, True, False)
    calls = ToolCalls(get_tool_parser("hermes"), TOOLS)
    return Reply(state, [[1, 2]], s, True, "req-1", None, calls)


def test_whole_response_has_tool_calls():
    out = RequestOutput(request_id=0, prompt_token_ids=[1, 2], token_ids=[5], text=TEXT)
    out.finish_reason = "stop"
    body = _reply().whole([out])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Let me look."
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_streamed_deltas_hold_the_call_back_then_send_it():
    calls = ToolCalls(get_tool_parser("hermes"), TOOLS).stream()
    sent, extra, reason = "", {}, None
    pieces = [TEXT[i : i + 5] for i in range(0, len(TEXT), 5)]
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        text, extra, reason = tool_delta(calls, piece, "stop" if last else None)
        sent += text
        if not last:
            assert "<tool" not in sent and not extra
    assert sent == "Let me look." and reason == "tool_calls"
    (call,) = extra["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"


def test_text_without_a_call_stays_content():
    out = RequestOutput(request_id=0, prompt_token_ids=[1], token_ids=[5], text="plain text")
    out.finish_reason = "length"
    choice = _reply().whole([out])["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "plain text"}
    assert choice["finish_reason"] == "length"
