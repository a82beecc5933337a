"""The OpenAI-compatible HTTP API on FastAPI: ``/v1/completions``, ``/v1/chat/completions``
(both with server-sent-event streaming), ``/v1/models``, ``/health`` and ``/metrics``.

Every request is checked completely at the door (its body's size, its JSON against the pydantic
schema of `splitmoe.server.protocol`, the limits, the prompt against the context, the model
name, the queue) before the engine sees it, so a bad request is a 4xx in OpenAI's error shape
that names the field, and costs the ranks nothing. Nothing a client sends holds the event loop:
a body must arrive within ``--request-read-timeout`` (408), a ``response_format`` schema is
judged once, in a process of its own, within ``--schema-check-timeout``
(`splitmoe.server.schema_check`), and tokenizing, templates, the per-sequence checks and
tool-call parsing run on worker threads. Every response carries an ``X-Request-Id``; a 5xx says
what failed in one line and gives that id, and the traceback goes to the server log under it: a
client never sees a traceback, a path or rank internals. A fault while serving one request (its
sampling, its stop strings, its detokenizing) fails that request alone. A client that
disconnects, streaming or not, aborts its sequences: their KV blocks are freed on their
attention ranks at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitmoe.attention_nodes.grammar import JSON_OBJECT_SCHEMA
from splitmoe.chat import ChatTemplate, ChatTemplateError
from splitmoe.config import EngineConfig
from splitmoe.inputs import check_request
from splitmoe.outputs import RequestOutput
from splitmoe.server.engine import AsyncEngine, EngineError, Job
from splitmoe.server.http import BodyLimit
from splitmoe.server.kv import KVGate, handoff, kv_status, parked_full, prefill_params
from splitmoe.server.metrics import ServerMetrics
from splitmoe.server.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    Limits,
    LogprobsFormat,
    Sampling,
    chat_messages,
    error_body,
    finish_reason,
    new_id,
    now,
    param_of,
    prompts_of,
    sampling,
    usage,
    validation_error,
)
from splitmoe.server.schema_check import SchemaBusy, SchemaChecker
from splitmoe.server.tool_parsers import ToolCallStream, ToolParser
from splitmoe.tokenizer import Tokenizer

logger = logging.getLogger("splitmoe")

_DEFAULT_MAX_TOKENS = 16  # (OpenAI's completions default)
_DISCONNECT_CHECK_S = 0.5  # how often a non-streaming request checks that its client is there
_QUEUE_RETRY_AFTER_S = 1  # Retry-After of a 503 for a full queue (a step frees sequences)


class HTTPError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.param, self.headers = status, kind, param, headers


class RequestFailed(Exception):
    """Generating one request failed (its own fault, e.g. in its sampling): a 500 for it
    alone; the details were logged under its request id."""


@dataclass
class ServerState:
    engine: AsyncEngine
    config: EngineConfig
    tokenizer: Tokenizer | None
    chat_template: ChatTemplate | None
    served_model_name: str
    api_keys: tuple[str, ...]  # empty: no key needed
    max_queued_requests: int | None
    metrics: ServerMetrics
    limits: Limits = Limits()
    tool_parser: ToolParser | None = None
    schemas: SchemaChecker | None = None  # (None: one is made from the limits)
    model_alias: str | None = None  # a name requests may use besides served_model_name
    inflight: int = 0  # sequences accepted and not finished (event-loop thread only)
    kv: KVGate = field(init=False)  # (prefill-decode: the router's secret, this instance's id)

    def __post_init__(self) -> None:
        self.kv = KVGate(self.config)

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


class _RequestContext:
    """ASGI middleware, outermost: every request gets an id (``request.state.request_id``, and
    ``X-Request-Id`` on its response); ``/v1/`` requests are authorized before their body is
    read; an exception no handler turned into a response is a 500 with the id, its traceback
    logged. (Plain ASGI rather than ``@app.middleware``: that one relays every streamed chunk
    through an extra task and queue.)"""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = new_id("req")
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [*message.get("headers", ()), (b"x-request-id", rid.encode())]
                message = {**message, "headers": headers}
            await send(message)

        if scope["path"].startswith("/v1/"):
            header = dict(scope.get("headers") or ()).get(b"authorization", b"")
            try:
                _authorize(header.decode("latin-1"), self.state)
            except HTTPError as e:
                body = error_body(str(e), e.kind, e.status, request_id=rid)
                return await JSONResponse(body, status_code=e.status)(scope, receive, send_with_id)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # (what no handler turned into a response: never a traceback out)
            logger.exception("request %s failed", rid)
            if not started:
                await _internal(rid)(scope, receive, send_with_id)


def build_app(state: ServerState) -> FastAPI:
    if state.schemas is None:
        state.schemas = SchemaChecker(state.limits.schema_check_timeout)
    schemas = state.schemas

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        # (the schema checker's process imports xgrammar, seconds: from now on, rather than
        # in the first structured request's time)
        warm = asyncio.create_task(_start_quietly(schemas))
        yield
        warm.cancel()
        await schemas.close()
        await asyncio.get_running_loop().run_in_executor(None, state.engine.stop)

    app = FastAPI(title="splitmoe", lifespan=lifespan)
    app.state.server = state

    app.add_middleware(
        BodyLimit,
        limit=state.limits.max_request_bytes,
        read_timeout=state.limits.request_read_timeout,
    )
    app.add_middleware(_RequestContext, state=state)  # (added last: the outermost)

    def _json_error(
        request: Request, message, kind, status, param=None, headers=None
    ) -> JSONResponse:
        rid = getattr(request.state, "request_id", None)
        body = error_body(message, kind, status, param, rid)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        message = {404: "no such endpoint", 405: "method not allowed here"}.get(
            exc.status_code, str(exc.detail)
        )
        return _json_error(
            request, f"{message}: {request.method} {request.url.path}", kind, exc.status_code
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return await _error(request, validation_error(exc.errors()))

    async def _error(request: Request, exc: Exception):
        status, kind = _status_of(exc)
        param, headers = getattr(exc, "param", None), _headers_of(exc)
        return _json_error(request, str(exc), kind, status, param, headers)

    for kind in _CLIENT_ERRORS:
        app.add_exception_handler(kind, _error)

    @app.get("/health")
    async def health():
        engine = state.engine
        if engine.state == "ready":  # (degraded: recovering from a lost rank, serving)
            return JSONResponse({"status": "ok" if engine.health == "ready" else engine.health})
        body = {"status": engine.state}
        if engine.public_error:
            body["error"] = engine.public_error
        return JSONResponse(body, status_code=503)

    @app.get("/internal/kv")
    async def kv_transfer(request: Request):
        # prefill-decode disaggregation (`splitmoe.router`): for the router alone
        if not state.kv.allows(request.headers, request.url.path.encode()):
            raise HTTPError(403, state.kv.refusal(), "permission_error")
        return kv_status(state.kv, state.engine.latest_stats())

    @app.get("/metrics")
    async def metrics():
        # the counters the ranks published last: no command to the engine thread, no wait on a
        # rank (asking them waited for their next step and paused token delivery meanwhile)
        engine = state.engine
        if engine.state == "ready":
            llm = engine.llm
            unfinished = llm.num_unfinished if llm else 0
            body = state.metrics.scrape(engine.latest_stats(), unfinished)
        else:
            body = state.metrics.render()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": state.served_model_name,
                    "object": "model",
                    "created": now(),
                    "owned_by": "splitmoe",
                    "root": state.served_model_name,  # (as vLLM: never a path of this host)
                    "max_model_len": state.config.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        _check_model(body.model, state)
        await _check_kv(request, body, state)
        s = sampling(body, state.limits, _DEFAULT_MAX_TOKENS, await _json_schema(body, schemas))
        texts = prompts_of(body, state.limits)
        # (tokenizing up to --max-request-bytes of text takes a while: off the event loop)
        prompts = await asyncio.to_thread(lambda: [_tokens(p, state) for p in texts])
        echo = None
        if s.echo:
            echo = [p if isinstance(p, str) else _decode(p, state) for p in texts]
        return await _generate(request, state, prompts, s, chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        _check_model(body.model, state)
        await _check_kv(request, body, state)
        schema = await _json_schema(body, schemas)
        s = sampling(body, state.limits, _default_chat_max(state), schema)
        if state.chat_template is None or state.tokenizer is None:
            raise BadRequest(
                f"the model {state.served_model_name!r} has no chat template (no 'chat_template' "
                "in its tokenizer_config.json, no chat_template.jinja, no --chat-template) or no "
                "tokenizer.json; add one or use /v1/completions",
                "messages",
            )
        if body.add_generation_prompt and body.continue_final_message:
            raise BadRequest(
                "'add_generation_prompt' and 'continue_final_message' cannot both be true",
                "continue_final_message",
            )
        tools = None
        if body.tools and body.tool_choice != "none":
            tools = [t.model_dump(exclude_none=True) for t in body.tools]
        try:
            prompt = await asyncio.to_thread(
                state.chat_template.prompt_ids,
                state.tokenizer,
                chat_messages(body),
                add_generation_prompt=(
                    not body.continue_final_message
                    if body.add_generation_prompt is None
                    else body.add_generation_prompt
                ),
                continue_final_message=bool(body.continue_final_message),
                tools=tools,
                chat_template_kwargs=body.chat_template_kwargs,
            )
        except ChatTemplateError as e:
            field = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
            raise BadRequest(str(e), field) from None
        if not prompt:
            raise BadRequest("the rendered chat prompt is empty", "messages")
        calls = _ToolCalls(state.tool_parser, tools) if tools and state.tool_parser else None
        return await _generate(request, state, [prompt], s, chat=True, tools=calls)

    return app


def _internal(rid: str) -> JSONResponse:
    return JSONResponse(
        error_body(str(_internal_error(rid)), "internal_error", 500, request_id=rid),
        status_code=500,
    )


def _internal_error(rid: str) -> RequestFailed:
    return RequestFailed(
        "internal error while serving this request; the server log has the details under "
        f"request id {rid}"
    )


def _check_model(model: str | None, state: ServerState) -> None:
    if model is not None and model not in (state.served_model_name, state.model_alias):
        raise HTTPError(
            404,
            f"the model {model!r} does not exist; this server serves "
            f"{state.served_model_name!r} (GET /v1/models)",
            "invalid_request_error",
            "model",
        )


async def _check_kv(request: Request, body, state: ServerState) -> None:
    """``kv_transfer_params`` come from the router alone (a 403 for anyone else)."""
    if body.kv_transfer_params is not None:
        if not state.kv.allows(request.headers, await request.body()):
            raise HTTPError(403, state.kv.refusal(), "permission_error", "kv_transfer_params")


async def _json_schema(
    body: CompletionRequest | ChatCompletionRequest, schemas: SchemaChecker
) -> str | None:
    """The grammar a ``response_format`` asks for, checked (a 400 for a schema it cannot be, or
    one too slow to convert; a 503 when the checks are busy)."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JSON_OBJECT_SCHEMA
    return await schemas.check(fmt.json_schema.schema_)


async def _start_quietly(schemas: SchemaChecker) -> None:
    try:
        await schemas.start()
    except Exception as e:  # (the first structured request will say what is wrong)
        logger.warning("the JSON schema checker did not start: %s", e)


def _default_chat_max(state: ServerState) -> int:
    # (what is left of the context: a request stops at max_model_len whatever its max_tokens)
    return state.config.max_model_len


def _authorize(header: str, state: ServerState) -> None:
    """``header``: the request's Authorization header ("" when it sent none)."""
    if not state.api_keys:
        return
    given = header.removeprefix("Bearer ").encode()
    # every key compared in constant time, all of them whatever matched: no timing tells how
    # much of a key was right, or which key
    ok = False
    for key in state.api_keys:
        ok |= hmac.compare_digest(given, key.encode())
    if not (ok and header.startswith("Bearer ")):
        raise HTTPError(
            401,
            "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
            if header
            else "missing API key: send the header 'Authorization: Bearer <key>'",
            "authentication_error",
        )


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


def _decode(ids: list[int], state: ServerState) -> str:
    return state.tokenizer.decode(ids) if state.tokenizer is not None else ""


async def _generate(
    request: Request,
    state: ServerState,
    prompts: list[list[int]],
    s: Sampling,
    chat: bool,
    echo: list[str] | None = None,
    tools: _ToolCalls | None = None,
):
    kv = s.params[0].kv_transfer_params
    if kv is not None and kv.do_remote_decode:  # (a prefill instance: see `server.kv`)
        return await _prefill(request, state, prompts, s, chat)
    # (linear in the prompts' tokens, and a schema's first check converts it: off the loop)
    seqs, params = await asyncio.to_thread(_sequences, state, prompts, s, chat)
    _check_queue(state, len(seqs))
    job = Job(seqs, params, s.stream, asyncio.get_running_loop())
    state.engine.submit(job)
    state.inflight += len(seqs)
    rid = request.state.request_id
    reply = _Reply(state, prompts, s, chat, rid, echo, tools)
    if s.stream:
        return StreamingResponse(reply.stream(request, job), media_type="text/event-stream")
    try:
        outputs = await _collect(request, state, job)
    finally:
        state.inflight -= len(seqs)
    if outputs is None:  # (the client left)
        return Response(status_code=499)
    # (tool-call parsing and logprobs formatting are linear in the output, which can be long:
    # off the event loop)
    return await asyncio.to_thread(reply.whole, outputs)


def _sequences(
    state: ServerState, prompts: list[list[int]], s: Sampling, chat: bool
) -> tuple[list[list[int]], list]:
    """Each prompt ``n`` times with its params, every pair checked (`check_request`)."""
    seqs, params = [], []
    for i, p in enumerate(prompts):
        for sp in s.params:
            try:
                if chat and not s.max_tokens_given:  # (the rest of the context, or KV pool)
                    sp = replace(sp, max_tokens=max(1, state.context_for_chat - len(p)))
                check_request(i, p, sp, state.config)
            except ValueError as e:
                raise BadRequest(str(e), param_of(str(e))) from None
            seqs.append(p)
            params.append(sp)
    return seqs, params


def _check_queue(state: ServerState, sequences: int) -> None:
    if state.max_queued_requests is not None:
        queued = max(0, state.inflight + sequences - state.capacity)
        if queued > state.max_queued_requests:
            raise HTTPError(
                503,
                f"the queue is full ({state.max_queued_requests} sequences may wait, "
                "--max-queued-requests); retry later",
                "service_unavailable",
                headers={"Retry-After": str(_QUEUE_RETRY_AFTER_S)},
            )


async def _prefill(
    request: Request, state: ServerState, prompts: list[list[int]], s: Sampling, chat: bool
):
    """A prefill instance's answer (`splitmoe.server.kv`): the request was checked as the
    client sent it; each prompt is computed once, its blocks parked for its ``n`` readers."""
    vocab = state.config.model.vocab_size
    one = prefill_params(s.params)
    try:
        for sp in s.params:
            sp.check_vocab(vocab)
        for i, p in enumerate(prompts):
            check_request(i, p, one, state.config)
    except ValueError as e:
        raise BadRequest(str(e), param_of(str(e))) from None
    if parked_full(state.engine.latest_stats()):
        raise HTTPError(
            503,
            "this prefill instance parks as much KV as it may (--kv-max-parked-blocks); the "
            "decode instance computes the prompt",
            "service_unavailable",
        )
    _check_queue(state, len(prompts))
    job = Job(prompts, [one] * len(prompts), False, asyncio.get_running_loop())
    state.engine.submit(job)
    state.inflight += len(prompts)
    try:
        outputs = await _collect(request, state, job)
    finally:
        state.inflight -= len(prompts)
    if outputs is None:  # (the client left)
        return Response(status_code=499)
    single = replace(
        s, params=[one], n=1, stream=False, include_usage=False, echo=False, logprobs=None
    )
    reply = _Reply(state, prompts, single, chat, request.state.request_id, None, None)
    body = reply.whole(outputs)
    body["kv_transfer_params"] = handoff(one.kv_transfer_params, state.engine.latest_stats())
    return body


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
                raise _as_http(items, request.state.request_id)
            for d in items:
                if d.output is not None:
                    outputs[d.index] = d.output
                    left -= 1
        job.done = True
        return outputs
    finally:
        state.engine.abort(job)  # (nothing when it finished)


def _as_http(exc: Exception, rid: str) -> Exception:
    if isinstance(exc, _CLIENT_ERRORS):
        return exc
    if isinstance(exc, (ValueError, TypeError)):  # (the engine's own check of a request)
        return BadRequest(str(exc))
    logger.error("request %s failed: %s: %s", rid, type(exc).__name__, exc)
    return _internal_error(rid)


def _failed_output(out: RequestOutput, rid: str, k: int) -> RequestFailed:
    logger.error("request %s, choice %d failed: %s", rid, k, out.error)
    return RequestFailed(
        f"generating choice {k} of this request failed; the server log has the details under "
        f"request id {rid}"
    )


def _prompt_usage(outputs: list[RequestOutput], n: int, prompts: list[list[int]]) -> dict:
    cached = []
    for i in range(len(prompts)):
        mine = [o.metrics.num_cached_tokens for o in outputs[i * n : (i + 1) * n] if o.metrics]
        cached.append(max(mine, default=0))
    return usage([len(p) for p in prompts], cached, outputs)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Reply:
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
                raise _failed_output(out, self.rid, k)
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
            "usage": _prompt_usage(outputs, self.s.n, self.prompts),
        }

    def _chunk(self, choices: list[dict], **extra) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return _sse(
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
                    raise _as_http(items, self.rid)
                parts = []
                for d in items:
                    if d.output is not None:
                        outputs[d.index] = d.output
                        left -= 1
                        if d.finish_reason == "error":
                            raise _failed_output(d.output, self.rid, d.index)
                    if not (d.text or d.finish_reason or d.token_ids):
                        continue
                    logprobs = None
                    if self.lp and d.token_ids and d.logprobs:
                        logprobs = self.lp.format(d.token_ids, d.logprobs, offsets[d.index])
                    offsets[d.index] += len(d.text)
                    reason = finish_reason(d.finish_reason)
                    text, extra = d.text, {}
                    if calls is not None and reason is None:  # (amortized O(1) a character)
                        text, extra, reason = _tool_delta(calls[d.index], text, reason)
                    elif calls is not None:  # (the whole text parsed: off the event loop)
                        call = calls[d.index]
                        text, extra, reason = await asyncio.to_thread(
                            _tool_delta, call, text, reason
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
                yield self._chunk([], usage=_prompt_usage(outputs, s.n, self.prompts))
            yield "data: [DONE]\n\n"
        except Exception as exc:  # (never a traceback: an error event, details in the log)
            err = exc
            if not isinstance(exc, _CLIENT_ERRORS):
                logger.exception("request %s failed while streaming", self.rid)
                err = _internal_error(self.rid)
            status, kind = _status_of(err)
            yield _sse(error_body(str(err), kind, status, getattr(err, "param", None), self.rid))
            job.done = True
        finally:
            state.engine.abort(job)  # (nothing when it finished)
            state.inflight -= n


@dataclass(frozen=True)
class _ToolCalls:
    """A chat request's tools and the server's parser for the calls in its output."""

    parser: ToolParser
    tools: list[dict]

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.parser, self.tools)


def _tool_delta(calls: ToolCallStream, text: str, reason):
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


def _status_of(err: Exception) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of one of `_CLIENT_ERRORS` (a 500 for others)."""
    if isinstance(err, (EngineError, SchemaBusy)):
        return 503, "service_unavailable"
    if isinstance(err, HTTPError):
        return err.status, err.kind
    if isinstance(err, BadRequest):
        return 400, "invalid_request_error"
    return 500, "internal_error"


def _headers_of(err: Exception) -> dict[str, str] | None:
    if isinstance(err, SchemaBusy):
        return {"Retry-After": str(err.retry_after)}
    return err.headers if isinstance(err, HTTPError) else None


# what a handler raises to answer with an error of OpenAI's shape (whole, or as a stream's
# error event)
_CLIENT_ERRORS = (HTTPError, BadRequest, EngineError, RequestFailed, SchemaBusy)
