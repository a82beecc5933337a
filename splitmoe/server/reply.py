"""A request's answer: one JSON body, or a stream of server-sent events (`Reply`), with the
chat tool calls parsed out of the text (`ToolCalls`)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from splitmoe.outputs import RequestOutput
from splitmoe.server.engine import Job
from splitmoe.server.protocol import (
    LogprobsFormat,
    Sampling,
    error_body,
    finish_reason,
    new_id,
    now,
    usage,
)
from splitmoe.server.state import CLIENT_ERRORS, RequestFailed, as_http, internal_error, status_of
from splitmoe.server.tool_parsers import ToolCallStream, ToolParser

logger = logging.getLogger("splitmoe")


def failed_output(out: RequestOutput, rid: str, k: int) -> RequestFailed:
    logger.error("request %s, choice %d failed: %s", rid, k, out.error)
    return RequestFailed(
        f"generating choice {k} of this request failed; the server log has the details under "
        f"request id {rid}"
    )


def prompt_usage(outputs: list[RequestOutput], n: int, prompts: list[list[int]]) -> dict:
    cached = []
    for i in range(len(prompts)):
        mine = [o.metrics.num_cached_tokens for o in outputs[i * n : (i + 1) * n] if o.metrics]
        cached.append(max(mine, default=0))
    return usage([len(p) for p in prompts], cached, outputs)


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Reply:
    """A request's response: one JSON body, or a stream of server-sent events."""

    def __init__(self, state, prompts, s: Sampling, chat: bool, rid: str, echo, tools):
        self.state, self.prompts, self.s, self.chat = state, prompts, s, chat
        self.rid, self.echo, self.tools = rid, echo, tools
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = now()
        self.lp = LogprobsFormat(state.tokenizer, chat) if s.logprobs is not None else None

    def _echo(self, k: int) -> str:
        return self.echo[k // self.s.n] if self.echo else ""

    def whole(self, outputs: list[RequestOutput]) -> dict:
        choices = []
        for k, out in enumerate(outputs):
            if out.finish_reason == "error":
                raise failed_output(out, self.rid, k)
            logprobs = self.lp.format(out.token_ids, out.logprobs) if self.lp else None
            reason = finish_reason(out.finish_reason)
            text = out.text or ""
            if self.chat:
                message = {"role": "assistant", "content": text}
                if self.tools is not None:
                    parsed = self.tools.parser.parse(text, self.tools.tools)
                    if parsed.tool_calls:
                        message["content"] = parsed.content
                        message["tool_calls"] = parsed.tool_calls
                        reason = "tool_calls" if reason == "stop" else reason
                choice = {
                    "index": k,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                }
            else:
                choice = {
                    "index": k,
                    "text": self._echo(k) + text,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                }
            if self.s.return_token_ids:
                choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.state.served_model_name,
            "choices": choices,
            "usage": prompt_usage(outputs, self.s.n, self.prompts),
        }

    def _chunk(self, choices: list[dict], **extra) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(
            {
                "id": self.id,
                "object": kind,
                "created": self.created,
                "model": self.state.served_model_name,
                "choices": choices,
                **extra,
            }
        )

    def _choice(self, k: int, text: str, reason, logprobs=None, token_ids=None, **delta) -> dict:
        if self.chat:
            d = {"content": text} if text or not reason else {}
            choice = {"index": k, "delta": {**d, **delta}}
        else:
            choice = {"index": k, "text": text}
        choice.update(logprobs=logprobs, finish_reason=reason)
        if self.s.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return choice

    async def stream(self, request: Request, job: Job) -> AsyncIterator[str]:
        """Server-sent events: a chunk per sequence and step, a usage chunk at the end when
        asked, then ``data: [DONE]``. A failure mid-stream is an error event (OpenAI's error
        shape, with the request id), and the stream ends."""
        state, s = self.state, self.s
        n = len(job.prompts)
        outputs: list[RequestOutput | None] = [None] * n
        offsets = [0] * n  # text sent per sequence (completions' logprobs text_offset)
        calls = [self.tools.stream() for _ in range(n)] if self.tools else None
        left = n
        try:
            if self.chat:  # the role first, as OpenAI sends it
                yield "".join(
                    self._chunk([self._choice(k, "", None, role="assistant")]) for k in range(n)
                )
            elif self.echo:
                yield "".join(self._chunk([self._choice(k, self._echo(k), None)]) for k in range(n))
            while left:
                items = await job.queue.get()
                if isinstance(items, Exception):
                    raise as_http(items, self.rid)
                parts = []
                for d in items:
                    if d.output is not None:
                        outputs[d.index] = d.output
                        left -= 1
                        if d.finish_reason == "error":
                            raise failed_output(d.output, self.rid, d.index)
                    if not (d.text or d.finish_reason or d.token_ids):
                        continue
                    logprobs = None
                    if self.lp and d.token_ids and d.logprobs:
                        logprobs = self.lp.format(d.token_ids, d.logprobs, offsets[d.index])
                    offsets[d.index] += len(d.text)
                    reason = finish_reason(d.finish_reason)
                    text, extra = d.text, {}
                    if calls is not None and reason is None:  # (amortized O(1) a character)
                        text, extra, reason = tool_delta(calls[d.index], text, reason)
                    elif calls is not None:  # (the whole text parsed: off the event loop)
                        call = calls[d.index]
                        text, extra, reason = await asyncio.to_thread(
                            tool_delta, call, text, reason
                        )
                    parts.append(
                        self._chunk(
                            [self._choice(d.index, text, reason, logprobs, d.token_ids, **extra)]
                        )
                    )
                if parts:
                    yield "".join(parts)
            job.done = True
            if s.include_usage:
                yield self._chunk([], usage=prompt_usage(outputs, s.n, self.prompts))
            yield "data: [DONE]\n\n"
        except Exception as exc:  # (never a traceback: an error event, details in the log)
            err = exc
            if not isinstance(exc, CLIENT_ERRORS):
                logger.exception("request %s failed while streaming", self.rid)
                err = internal_error(self.rid)
            status, kind = status_of(err)
            yield sse(error_body(str(err), kind, status, getattr(err, "param", None), self.rid))
            job.done = True
        finally:
            state.engine.abort(job)  # (nothing when it finished)
            state.inflight -= n


@dataclass(frozen=True)
class ToolCalls:
    """A chat request's tools and the server's parser for the calls in its output."""

    parser: ToolParser
    tools: list[dict]

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.parser, self.tools)


def tool_delta(calls: ToolCallStream, text: str, reason):
    """A streamed choice's text with a tool-call parser: content passes as it comes, text from
    where a call may begin is held back; at the end what was held is content and
    ``tool_calls``."""
    out = calls.feed(text)
    if reason is None:
        return out, {}, reason
    parsed = calls.finish()
    out += parsed.content or ""
    if not parsed.tool_calls:
        return out, {}, reason
    extra = {"tool_calls": [{"index": i, **c} for i, c in enumerate(parsed.tool_calls)]}
    return out, extra, "tool_calls" if reason == "stop" else reason
