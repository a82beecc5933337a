"""The OpenAI-compatible HTTP API on FastAPI: ``/v1/completions``, ``/v1/chat/completions``
(both with server-sent-event streaming), ``/v1/models``, ``/health`` and ``/metrics``.

Handlers check a request completely (fields, prompt length against the context, the model name,
the queue) before the engine sees it, so a bad request is a 400/404/503 in OpenAI's error shape
and costs the ranks nothing. A client that disconnects, streaming or not, aborts its sequences:
their KV blocks are freed on their attention ranks at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from splitmoe.chat import ChatTemplate, ChatTemplateError
from splitmoe.config import EngineConfig
from splitmoe.inputs import check_request
from splitmoe.outputs import RequestOutput
from splitmoe.server.engine import AsyncEngine, EngineError, Job
from splitmoe.server.metrics import ServerMetrics
from splitmoe.server.protocol import (
    BadRequest,
    LogprobsFormat,
    Sampling,
    error_body,
    finish_reason,
    new_id,
    now,
    parse_messages,
    parse_prompts,
    parse_sampling,
    usage,
)
from splitmoe.tokenizer import Tokenizer

logger = logging.getLogger("splitmoe")

_DEFAULT_MAX_TOKENS = 16  # (OpenAI's completions default)
_DISCONNECT_CHECK_S = 0.5  # how often a non-streaming request checks that its client is there


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


@dataclass
class ServerState:
    engine: AsyncEngine
    config: EngineConfig
    tokenizer: Tokenizer | None
    chat_template: ChatTemplate | None
    served_model_name: str
    api_key: str | None
    max_queued_requests: int | None
    metrics: ServerMetrics
    inflight: int = 0  # sequences accepted and not finished (event-loop thread only)

    @property
    def context_for_chat(self) -> int:
        """Prompt + output tokens a chat request without max_tokens may reach."""
        cfg = self.config
        blocks = cfg.cache.resolve_num_blocks(
            cfg.model, cfg.torch_dtype, cfg.scheduler.max_num_seqs, cfg.max_model_len
        )
        return min(cfg.max_model_len, blocks * cfg.cache.block_size + 1)

    @property
    def capacity(self) -> int:
        """Sequences the attention ranks run at once; more wait in their queues."""
        return self.config.scheduler.max_num_seqs * self.config.parallel.attention_ranks


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, state.engine.stop)

    app = FastAPI(title="splitmoe", lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError):
        return JSONResponse(
            error_body(str(exc), exc.kind, exc.status, exc.param), status_code=exc.status
        )

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, exc: BadRequest):
        return JSONResponse(
            error_body(str(exc), "invalid_request_error", 400, exc.param), status_code=400
        )

    @app.exception_handler(EngineError)
    async def _unavailable(request: Request, exc: EngineError):
        return JSONResponse(error_body(str(exc), "service_unavailable", 503), status_code=503)

    @app.get("/health")
    async def health():
        engine = state.engine
        if engine.state == "ready":
            return JSONResponse({"status": "ok"})
        body = {"status": engine.state}
        if engine.error:
            body["error"] = engine.error
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics():
        # the counters the ranks published last: no command to the engine thread, no wait on a
        # rank (asking them waited for their next step and paused token delivery meanwhile)
        engine = state.engine
        if engine.state == "ready":
            llm = engine.llm
            unfinished = llm.num_unfinished if llm else 0
            state.metrics.update_from_stats(engine.latest_stats(), unfinished)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        _authorize(request, state)
        return {
            "object": "list",
            "data": [
                {
                    "id": state.served_model_name,
                    "object": "model",
                    "created": now(),
                    "owned_by": "splitmoe",
                    "root": state.config.model.path,
                    "max_model_len": state.config.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _read_body(request, state)
        sampling = parse_sampling(body, chat=False, default_max_tokens=_DEFAULT_MAX_TOKENS)
        prompts = [_tokens(p, state) for p in parse_prompts(body)]
        return await _generate(request, state, prompts, sampling, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _read_body(request, state)
        sampling = parse_sampling(body, chat=True, default_max_tokens=_default_chat_max(state))
        messages = parse_messages(body)
        if state.chat_template is None or state.tokenizer is None:
            raise BadRequest(
                f"the model {state.served_model_name!r} has no chat template (no 'chat_template' "
                "in its tokenizer_config.json, no chat_template.jinja) or no tokenizer.json; add "
                "one or use /v1/completions",
                "messages",
            )
        try:
            text = state.chat_template.render(
                messages, add_generation_prompt=bool(body.get("add_generation_prompt", True))
            )
        except ChatTemplateError as e:
            raise BadRequest(str(e), "messages") from None
        prompt = state.tokenizer.encode(text)
        if not prompt:
            raise BadRequest("the rendered chat prompt is empty", "messages")
        return await _generate(request, state, [prompt], sampling, chat=True)

    return app


def _default_chat_max(state: ServerState) -> int:
    # (what is left of the context: a request stops at max_model_len whatever its max_tokens)
    return state.config.max_model_len


def _authorize(request: Request, state: ServerState) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    if header != f"Bearer {state.api_key}":
        raise HTTPError(
            401,
            "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
            if header
            else "missing API key: send the header 'Authorization: Bearer <key>'",
            "authentication_error",
        )


async def _read_body(request: Request, state: ServerState) -> dict:
    _authorize(request, state)
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != state.served_model_name:
        raise HTTPError(
            404,
            f"the model {model!r} does not exist; this server serves "
            f"{state.served_model_name!r} (GET /v1/models)",
            "invalid_request_error",
            "model",
        )
    return body


def _tokens(prompt, state: ServerState) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if state.tokenizer is None:
        raise BadRequest(
            "text prompts need the model's tokenizer.json; send token ids instead", "prompt"
        )
    ids = state.tokenizer.encode(prompt)
    if not ids:
        raise BadRequest("the prompt encodes to no tokens", "prompt")
    return ids


async def _generate(
    request: Request, state: ServerState, prompts: list[list[int]], s: Sampling, chat: bool
):
    seqs, params = [], []
    for i, p in enumerate(prompts):
        for sp in s.params:
            if chat and not s.max_tokens_given:  # (the rest of the context, or of the KV pool)
                sp = replace(sp, max_tokens=max(1, state.context_for_chat - len(p)))
            try:
                check_request(i, p, sp, state.config)
            except ValueError as e:
                raise BadRequest(str(e), "prompt" if "prompt" in str(e) else None) from None
            seqs.append(p)
            params.append(sp)
    if state.max_queued_requests is not None:
        queued = max(0, state.inflight + len(seqs) - state.capacity)
        if queued > state.max_queued_requests:
            raise HTTPError(
                503,
                f"the queue is full ({state.max_queued_requests} requests wait already); "
                "retry later",
                "service_unavailable",
            )
    job = Job(seqs, params, s.stream, asyncio.get_running_loop())
    state.engine.submit(job)
    state.inflight += len(seqs)
    if s.stream:
        return StreamingResponse(
            _stream(request, state, job, prompts, s, chat), media_type="text/event-stream"
        )
    try:
        outputs = await _collect(request, state, job)
    finally:
        state.inflight -= len(seqs)
    if outputs is None:  # (the client left)
        return Response(status_code=499)
    return _response(state, job, prompts, s, chat, outputs)


async def _collect(request: Request, state: ServerState, job: Job) -> list[RequestOutput] | None:
    outputs: list[RequestOutput | None] = [None] * len(job.prompts)
    left = len(outputs)
    try:
        while left:
            try:
                items = await asyncio.wait_for(job.queue.get(), _DISCONNECT_CHECK_S)
            except TimeoutError:
                if await request.is_disconnected():
                    return None
                continue
            if isinstance(items, Exception):
                raise _as_http(items)
            for d in items:
                if d.output is not None:
                    outputs[d.index] = d.output
                    left -= 1
        job.done = True
        return outputs
    finally:
        state.engine.abort(job)  # (nothing when it finished)


def _as_http(exc: Exception) -> Exception:
    if isinstance(exc, EngineError):
        return exc
    if isinstance(exc, (ValueError, TypeError)):
        return BadRequest(str(exc))
    return HTTPError(500, f"{type(exc).__name__}: {exc}", "internal_error")


def _prompt_usage(outputs: list[RequestOutput], n: int, prompts: list[list[int]]) -> dict:
    cached = []
    for i in range(len(prompts)):
        mine = [o.metrics.num_cached_tokens for o in outputs[i * n : (i + 1) * n] if o.metrics]
        cached.append(max(mine, default=0))
    return usage([len(p) for p in prompts], cached, outputs)


def _response(state, job: Job, prompts, s: Sampling, chat: bool, outputs) -> dict:
    lp = LogprobsFormat(state.tokenizer, chat) if s.logprobs is not None else None
    choices = []
    for k, out in enumerate(outputs):
        logprobs = lp.format(out.token_ids, out.logprobs) if lp else None
        reason = finish_reason(out.finish_reason)
        if chat:
            choices.append(
                {
                    "index": k,
                    "message": {"role": "assistant", "content": out.text or ""},
                    "logprobs": logprobs,
                    "finish_reason": reason,
                }
            )
        else:
            choices.append(
                {"index": k, "text": out.text or "", "logprobs": logprobs, "finish_reason": reason}
            )
        if s.return_token_ids:
            choices[-1]["token_ids"] = list(out.token_ids)
    return {
        "id": new_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion" if chat else "text_completion",
        "created": now(),
        "model": state.served_model_name,
        "choices": choices,
        "usage": _prompt_usage(outputs, s.n, prompts),
    }


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _stream(
    request: Request, state: ServerState, job: Job, prompts, s: Sampling, chat: bool
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per sequence and step, a usage chunk at the end when asked,
    then ``data: [DONE]``. A failure mid-stream is an error event (OpenAI's error shape)."""
    rid, created, name = new_id("chatcmpl" if chat else "cmpl"), now(), state.served_model_name
    kind = "chat.completion.chunk" if chat else "text_completion"
    lp = LogprobsFormat(state.tokenizer, chat) if s.logprobs is not None else None
    n = len(job.prompts)
    outputs: list[RequestOutput | None] = [None] * n
    offsets = [0] * n  # text sent per sequence (completions' logprobs text_offset)
    left = n

    def chunk(choices: list[dict]) -> str:
        return _sse(
            {"id": rid, "object": kind, "created": created, "model": name, "choices": choices}
        )

    try:
        if chat:  # the role first, as OpenAI sends it
            yield "".join(
                chunk(
                    [
                        {
                            "index": k,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
                for k in range(n)
            )
        while left:
            items = await job.queue.get()
            if isinstance(items, Exception):
                err = _as_http(items)
                if isinstance(err, EngineError):
                    body = error_body(str(err), "service_unavailable", 503)
                else:
                    body = error_body(
                        str(err),
                        getattr(err, "kind", "invalid_request_error"),
                        getattr(err, "status", 400),
                    )
                yield _sse(body)
                job.done = True
                return
            parts = []
            for d in items:
                if d.output is not None:
                    outputs[d.index] = d.output
                    left -= 1
                if not (d.text or d.finish_reason or d.token_ids):
                    continue
                logprobs = None
                if lp and d.token_ids and d.logprobs:
                    logprobs = lp.format(d.token_ids, d.logprobs, offsets[d.index])
                offsets[d.index] += len(d.text)
                reason = finish_reason(d.finish_reason)
                if chat:
                    delta = {"content": d.text} if d.text or not reason else {}
                    choice = {"index": d.index, "delta": delta}
                else:
                    choice = {"index": d.index, "text": d.text}
                choice.update(logprobs=logprobs, finish_reason=reason)
                if s.return_token_ids:
                    choice["token_ids"] = d.token_ids
                parts.append(chunk([choice]))
            if parts:
                yield "".join(parts)
        job.done = True
        if s.include_usage:
            yield _sse(
                {
                    "id": rid,
                    "object": kind,
                    "created": created,
                    "model": name,
                    "choices": [],
                    "usage": _prompt_usage(outputs, s.n, prompts),
                }
            )
        yield "data: [DONE]\n\n"
    finally:
        state.engine.abort(job)  # (nothing when it finished)
        state.inflight -= n
