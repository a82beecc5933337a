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
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitmoe.chat import ChatTemplateError
from splitmoe.server.generate import (
    DEFAULT_MAX_TOKENS,
    check_kv,
    check_model,
    decode_text,
    default_chat_max,
    generate,
    json_schema,
    prompt_tokens,
    start_quietly,
)
from splitmoe.server.http import BodyLimit
from splitmoe.server.kv import kv_status
from splitmoe.server.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    error_body,
    new_id,
    now,
    prompts_of,
    sampling,
    validation_error,
)
from splitmoe.server.reply import ToolCalls
from splitmoe.server.schema_check import SchemaChecker
from splitmoe.server.state import (
    CLIENT_ERRORS,
    HTTPError,
    ServerState,
    authorize,
    headers_of,
    internal_response,
    status_of,
)

logger = logging.getLogger("splitmoe")


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
                authorize(header.decode("latin-1"), self.state)
            except HTTPError as e:
                body = error_body(str(e), e.kind, e.status, request_id=rid)
                return await JSONResponse(body, status_code=e.status)(scope, receive, send_with_id)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # (what no handler turned into a response: never a traceback out)
            logger.exception("request %s failed", rid)
            if not started:
                await internal_response(rid)(scope, receive, send_with_id)


def build_app(state: ServerState) -> FastAPI:
    """The app: its middleware, error handlers and routes."""
    if state.schemas is None:
        state.schemas = SchemaChecker(state.limits.schema_check_timeout)
    schemas = state.schemas

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        # (the schema checker's process imports xgrammar, seconds: from now on, rather than
        # in the first structured request's time)
        warm = asyncio.create_task(start_quietly(schemas))
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

    _error_handlers(app)
    _info_routes(app, state)
    _generation_routes(app, state, schemas)
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error a handler raises, or FastAPI and Starlette find, in OpenAI's shape."""

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
        status, kind = status_of(exc)
        param, headers = getattr(exc, "param", None), headers_of(exc)
        return _json_error(request, str(exc), kind, status, param, headers)

    for kind in CLIENT_ERRORS:
        app.add_exception_handler(kind, _error)


def _info_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /internal/kv, /metrics, /v1/models."""

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
        # rank (asking them would wait for their next step and pause token delivery meanwhile)
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


def _generation_routes(app: FastAPI, state: ServerState, schemas: SchemaChecker) -> None:
    """/v1/completions and /v1/chat/completions."""

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        check_model(body.model, state)
        await check_kv(request, body, state)
        s = sampling(body, state.limits, DEFAULT_MAX_TOKENS, await json_schema(body, schemas))
        texts = prompts_of(body, state.limits)
        # (tokenizing up to --max-request-bytes of text takes a while: off the event loop)
        prompts = await asyncio.to_thread(lambda: [prompt_tokens(p, state) for p in texts])
        echo = None
        if s.echo:
            echo = [p if isinstance(p, str) else decode_text(p, state) for p in texts]
        return await generate(request, state, prompts, s, chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        check_model(body.model, state)
        await check_kv(request, body, state)
        schema = await json_schema(body, schemas)
        s = sampling(body, state.limits, default_chat_max(state), schema)
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
        calls = ToolCalls(state.tool_parser, tools) if tools and state.tool_parser else None
        return await generate(request, state, [prompt], s, chat=True, tools=calls)
