"""The router's HTTP app (FastAPI) and its command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitmoe.kv_transfer.auth import require_secret
from splitmoe.router.core import Router, Timeouts
from splitmoe.router.upstream import error_response, relayed_error
from splitmoe.server.http import BodyLimit
from splitmoe.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Limits,
    validation_error,
)


def build_app(router: Router, limits: Limits | None = None) -> FastAPI:
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="splitmoe router", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=(limits or Limits()).max_request_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        err = validation_error(exc.errors())
        return error_response(400, str(err), getattr(err, "param", None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = {404: "no such endpoint", 405: "method not allowed here"}.get(
            exc.status_code, str(exc.detail)
        )
        return error_response(exc.status_code, f"{message}: {request.method} {request.url.path}")

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await router.handle("/v1/completions", request, await request.json())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await router.handle("/v1/chat/completions", request, await request.json())

    @app.get("/v1/models")
    async def models(request: Request):
        for inst in router.decode_order():
            try:
                r = await asyncio.wait_for(
                    router.client.get(inst.url + "/v1/models", headers=_auth(request)),
                    router.timeouts.prefill,
                )
            except (httpx.HTTPError, TimeoutError):
                continue
            if r.status_code == 200:
                return Response(r.content, 200, media_type="application/json")
            return relayed_error(r)
        return error_response(503, "no decode instance could be reached")

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(router.counters), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        body, status = await router.health()
        return JSONResponse(body, status)

    return app


def _auth(request: Request) -> dict:
    h = request.headers.get("authorization")
    return {"Authorization": h} if h else {}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m splitmoe.router",
        description="OpenAI-compatible router in front of prefill and decode instances",
    )
    d = Timeouts()
    ap.add_argument("--prefill", nargs="+", required=True, help="prefill instances' URLs")
    ap.add_argument("--decode", nargs="+", required=True, help="decode instances' URLs")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument(
        "--kv-secret-file",
        default=None,
        help="file holding the secret shared with the instances (else SPLITMOE_KV_SECRET)",
    )
    ap.add_argument(
        "--prefill-timeout",
        type=float,
        default=d.prefill,
        help=f"seconds a prefill instance may take (then the next, or the decode instance "
        f"computes the prompt; default {d.prefill:g})",
    )
    ap.add_argument(
        "--decode-timeout",
        type=float,
        default=None,
        help=f"seconds a decode instance may take for a whole answer, or stay silent in a "
        f"stream (default {d.decode:g})",
    )
    ap.add_argument(
        "--timeout", type=float, default=None, help="the same as --decode-timeout (older name)"
    )
    ap.add_argument(
        "--health-timeout",
        type=float,
        default=d.health,
        help=f"seconds each instance's /health may take (default {d.health:g})",
    )
    ap.add_argument(
        "--max-request-bytes",
        type=int,
        default=Limits().max_request_bytes,
        help="largest request body; a larger one is a 413",
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s router %(levelname)s %(message)s",
    )
    decode = args.decode_timeout if args.decode_timeout is not None else args.timeout
    try:
        secret = require_secret(args.kv_secret_file, "the prefill-decode router")
        timeouts = Timeouts(
            prefill=args.prefill_timeout,
            decode=Timeouts.decode if decode is None else decode,
            health=args.health_timeout,
        )
        for name in ("prefill", "decode", "health"):
            if not getattr(timeouts, name) > 0:
                raise ValueError(f"--{name}-timeout must be > 0")
        limits = Limits(max_request_bytes=args.max_request_bytes)
        router = Router(args.prefill, args.decode, secret, timeouts)
    except ValueError as e:
        print(f"splitmoe.router: error: {e}", file=sys.stderr)
        return 2
    uvicorn.run(build_app(router, limits), host=args.host, port=args.port, log_level="warning")
    return 0
