"""What the server's handlers share: its state, its error types and how each becomes an HTTP
answer in OpenAI's shape, and the API-key check."""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse

from splitmoe.chat import ChatTemplate
from splitmoe.config import EngineConfig
from splitmoe.server.engine import AsyncEngine, EngineError
from splitmoe.server.kv import KVGate
from splitmoe.server.metrics import ServerMetrics
from splitmoe.server.protocol import (
    BadRequest,
    Limits,
    error_body,
)
from splitmoe.server.schema_check import SchemaBusy, SchemaChecker
from splitmoe.server.tool_parsers import ToolParser
from splitmoe.tokenizer import Tokenizer

logger = logging.getLogger("splitmoe")


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


def internal_response(rid: str) -> JSONResponse:
    return JSONResponse(
        error_body(str(internal_error(rid)), "internal_error", 500, request_id=rid),
        status_code=500,
    )


def internal_error(rid: str) -> RequestFailed:
    return RequestFailed(
        "internal error while serving this request; the server log has the details under "
        f"request id {rid}"
    )


def authorize(header: str, state: ServerState) -> None:
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


def status_of(err: Exception) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of one of `CLIENT_ERRORS` (a 500 for others)."""
    if isinstance(err, (EngineError, SchemaBusy)):
        return 503, "service_unavailable"
    if isinstance(err, HTTPError):
        return err.status, err.kind
    if isinstance(err, BadRequest):
        return 400, "invalid_request_error"
    return 500, "internal_error"


def headers_of(err: Exception) -> dict[str, str] | None:
    if isinstance(err, SchemaBusy):
        return {"Retry-After": str(err.retry_after)}
    return err.headers if isinstance(err, HTTPError) else None


# what a handler raises to answer with an error of OpenAI's shape (whole, or as a stream's
# error event)
CLIENT_ERRORS = (HTTPError, BadRequest, EngineError, RequestFailed, SchemaBusy)


def as_http(exc: Exception, rid: str) -> Exception:
    if isinstance(exc, CLIENT_ERRORS):
        return exc
    if isinstance(exc, (ValueError, TypeError)):  # (the engine's own check of a request)
        return BadRequest(str(exc))
    logger.error("request %s failed: %s: %s", rid, type(exc).__name__, exc)
    return internal_error(rid)
