"""The prefill-decode router: the OpenAI API in front of prefill and decode instances.

``python -m splitmoe.router --prefill URL [URL ...] --decode URL [URL ...] --port P``

Each completion goes first to a prefill instance (``kv_role="prefill"``), as the same request
with ``max_tokens=1``, ``n=1`` and ``kv_transfer_params={"do_remote_decode": true, ...}``: it
computes the prompt and parks its KV blocks. Then the request as the client sent it goes to a
decode instance with ``kv_transfer_params={"do_remote_prefill": true, "remote_agents": [...]}``
(the prefill instance's KV agents, from its ``GET /internal/kv``): its ranks pull the blocks
with the connector and generate; the decode instance's answer (streamed or whole) is the
client's, with ``usage.prompt_tokens_details.cached_tokens`` taken from the prefill instance.

The prefill instance is chosen by cached prefix (the prompts each instance was sent lately,
hashed in 64-character or 16-token chunks) and then by load (requests in flight); the decode
instance by load. Failures: a prefill instance that cannot be reached or answers 5xx is
skipped for the next one; with none left the decode instance computes the prompt itself (it
also does when its pull fails). A decode instance that cannot be reached is skipped likewise;
with none left, or one that fails mid-stream, the client gets an error, never a hang (every
call has a timeout).

``GET /metrics`` gives the client's TTFT as the router sees it, split: the prefill stage
(``splitmoe:pd_prefill_seconds``, retries included) and the decode instance's part up to the
first streamed token (``splitmoe:pd_decode_first_token_seconds``), which its own ``/metrics``
splits again into the KV pull and the first step (`splitmoe.server.metrics`).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    Histogram,
    generate_latest,
)

from splitmoe.server.metrics import _LATENCY_BUCKETS

logger = logging.getLogger("splitmoe.router")

_CHUNK_CHARS, _CHUNK_TOKENS = 64, 16  # prefix granularity of the router's cache guess
_PREFIXES_KEPT = 4096  # chunk digests remembered per prefill instance (LRU)
_LOAD_SLACK = 4  # a prefix hit wins unless its instance has this many more requests in flight


@dataclass
class Instance:
    """One splitmoe server the router sends to."""

    url: str
    inflight: int = 0
    failures: int = 0
    agents: list[str] | None = None  # (prefill) its ranks' KV agents, once asked
    prefixes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def matched(self, chunks: list[bytes]) -> int:
        n = 0
        for c in chunks:
            if c not in self.prefixes:
                break
            n += 1
        return n

    def remember(self, chunks: list[bytes]) -> None:
        for c in chunks:
            self.prefixes[c] = None
            self.prefixes.move_to_end(c)
        while len(self.prefixes) > _PREFIXES_KEPT:
            self.prefixes.popitem(last=False)


def prefix_chunks(body: dict) -> list[bytes]:
    """Chained digests of the request's prompt in fixed chunks (text, token ids or chat
    messages): two requests share a leading run exactly when their prompts share a prefix of
    that many chunks."""
    prompt = body.get("messages", body.get("prompt"))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        units = [
            json.dumps(prompt[i : i + _CHUNK_TOKENS]) for i in range(0, len(prompt), _CHUNK_TOKENS)
        ]
        units = units[:-1] if len(prompt) % _CHUNK_TOKENS else units
    else:
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
        n = len(text) // _CHUNK_CHARS * _CHUNK_CHARS
        units = [text[i : i + _CHUNK_CHARS] for i in range(0, n, _CHUNK_CHARS)]
    out, parent = [], b""
    for u in units:
        parent = hashlib.sha256(parent + u.encode()).digest()
        out.append(parent)
    return out


class RouterMetrics:
    """The router's ``/metrics``: where a client's time to first token went."""

    def __init__(self):
        self.registry = r = CollectorRegistry()

        def histogram(name, doc):
            return Histogram(f"splitmoe:{name}", doc, buckets=_LATENCY_BUCKETS, registry=r)

        self.prefill = histogram(
            "pd_prefill_seconds", "Prefill stage: the prefill instance's answer, retries included"
        )
        self.decode_first = histogram(
            "pd_decode_first_token_seconds",
            "Streamed requests: end of the prefill stage to the decode instance's first token",
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Streamed requests: arrival to first token"
        )
        self.counters = Gauge("splitmoe:router_events", "Router counters", ["event"], registry=r)

    def render(self, counters: dict) -> bytes:
        for k, v in counters.items():
            self.counters.labels(event=k).set(v)
        return generate_latest(self.registry)


class RouterError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Router:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
    ):
        if not prefill or not decode:
            raise ValueError("the router needs at least one prefill and one decode instance")
        self.prefill = [Instance(u.rstrip("/")) for u in prefill]
        self.decode = [Instance(u.rstrip("/")) for u in decode]
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.client: httpx.AsyncClient | None = None
        self.counters = {"requests": 0, "prefill_retries": 0, "prefill_fallbacks": 0}
        self.metrics = RouterMetrics()

    async def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=self.timeout)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    # ---- choosing ------------------------------------------------------------------------------

    def prefill_order(self, chunks: list[bytes]) -> list[Instance]:
        """Prefill instances best first: the longest cached prefix among those within
        `_LOAD_SLACK` of the least loaded, then the least loaded, then failures last."""
        least = min(i.inflight for i in self.prefill)

        def key(inst: Instance):
            hit = inst.matched(chunks) if inst.inflight <= least + _LOAD_SLACK else 0
            return (inst.failures > 0, -hit, inst.inflight)

        return sorted(self.prefill, key=key)

    def decode_order(self) -> list[Instance]:
        return sorted(self.decode, key=lambda i: (i.failures > 0, i.inflight))

    async def agents(self, inst: Instance, headers: dict) -> list[str]:
        if not inst.agents:
            r = await self.client.get(inst.url + "/internal/kv", headers=headers)
            r.raise_for_status()
            inst.agents = list(r.json().get("agents") or [])
        return inst.agents

    # ---- one request ---------------------------------------------------------------------------

    async def prefill_step(
        self, path: str, body: dict, headers: dict, transfer_id: str
    ) -> tuple[dict | None, Response | None]:
        """Runs the prompt on a prefill instance; returns ``(decode's kv_transfer_params,
        cached tokens)`` as a dict, or (None, None) when no prefill instance could (the decode
        instance then computes the prompt), or (None, response) for the client's own error."""
        n = body.get("n") or 1
        pre = dict(body, max_tokens=1, n=1, stream=False)
        for k in ("max_completion_tokens", "min_tokens", "stream_options"):
            pre.pop(k, None)
        pre["kv_transfer_params"] = {
            "transfer_id": transfer_id,
            "do_remote_decode": True,
            "num_readers": n if isinstance(n, int) and n >= 1 else 1,
        }
        chunks = prefix_chunks(body)
        for attempt, inst in enumerate(self.prefill_order(chunks)):
            if attempt:
                self.counters["prefill_retries"] += 1
            inst.inflight += 1
            try:
                r = await self.client.post(inst.url + path, json=pre, headers=headers)
                if r.status_code >= 500:
                    raise httpx.HTTPStatusError("prefill failed", request=r.request, response=r)
                if r.status_code >= 400:  # the client's request: said as the instance says it
                    return None, Response(r.content, r.status_code, media_type="application/json")
                usage = r.json().get("usage") or {}
                agents = await self.agents(inst, headers)
            except (httpx.HTTPError, ValueError) as e:
                inst.failures += 1
                inst.agents = None
                logger.warning("prefill instance %s failed (%s); trying the next", inst.url, e)
                continue
            finally:
                inst.inflight -= 1
            inst.failures = 0
            inst.remember(chunks)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            params = {
                "transfer_id": transfer_id,
                "do_remote_prefill": True,
                "remote_agents": agents,
            }
            return {"params": params, "cached": cached}, None
        self.counters["prefill_fallbacks"] += 1
        logger.warning("no prefill instance answered; the decode instance computes the prompt")
        return None, None

    async def handle(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        if "kv_transfer_params" in body:
            return _error(400, "kv_transfer_params is set by the router, not by clients")
        self.counters["requests"] += 1
        headers = {}
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        t0 = time.perf_counter()
        handoff, refused = await self.prefill_step(path, body, headers, uuid.uuid4().hex)
        if refused is not None:
            return refused
        t1 = time.perf_counter()
        if handoff is not None:
            self.metrics.prefill.observe(t1 - t0)
        dec = dict(body)
        cached = None
        if handoff is not None:
            dec["kv_transfer_params"] = handoff["params"]
            cached = handoff["cached"]
        if body.get("stream"):
            return await self._stream(path, dec, headers, cached, (t0, t1))
        for inst in self.decode_order():
            inst.inflight += 1
            try:
                r = await self.client.post(inst.url + path, json=dec, headers=headers)
            except httpx.HTTPError as e:
                inst.failures += 1
                logger.warning("decode instance %s failed (%s)", inst.url, e)
                continue
            finally:
                inst.inflight -= 1
            inst.failures = 0
            if r.status_code != 200:
                return Response(r.content, r.status_code, media_type="application/json")
            out = r.json()
            _set_cached(out, cached)
            return JSONResponse(out)
        return _error(503, "no decode instance could be reached")

    async def _stream(
        self, path: str, body: dict, headers: dict, cached, times: tuple[float, float]
    ) -> Response:
        for inst in self.decode_order():
            inst.inflight += 1
            try:
                req = self.client.build_request("POST", inst.url + path, json=body, headers=headers)
                r = await self.client.send(req, stream=True)
            except httpx.HTTPError as e:
                inst.inflight -= 1
                inst.failures += 1
                logger.warning("decode instance %s failed (%s)", inst.url, e)
                continue
            inst.failures = 0
            if r.status_code != 200:
                content = await r.aread()
                await r.aclose()
                inst.inflight -= 1
                return Response(content, r.status_code, media_type="application/json")
            relay = self._relay(inst, r, cached, times)
            return StreamingResponse(relay, media_type="text/event-stream")
        return _error(503, "no decode instance could be reached")

    async def _relay(
        self, inst: Instance, r: httpx.Response, cached, times: tuple[float, float]
    ) -> AsyncIterator[str]:
        """The decode instance's events as they come (usage's cached tokens replaced); an error
        event if it fails mid-stream. ``times``: when the request came and its prefill stage
        ended (`perf_counter`), for the first token's metrics."""
        done = first = False
        try:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                elif not first and _has_token(data):
                    first = True
                    now = time.perf_counter()
                    self.metrics.ttft.observe(now - times[0])
                    self.metrics.decode_first.observe(now - times[1])
                elif cached is not None and '"usage"' in data:
                    obj = json.loads(data)
                    _set_cached(obj, cached)
                    data = json.dumps(obj)
                yield f"data: {data}\n\n"
        except httpx.HTTPError as e:
            logger.warning("decode instance %s failed mid-stream (%s)", inst.url, e)
        finally:
            inst.inflight -= 1
            await r.aclose()
        if not done:
            err = {"error": {"message": "the decode instance failed", "type": "server_error"}}
            yield f"data: {json.dumps(err)}\n\n"
        yield "data: [DONE]\n\n"


def _has_token(data: str) -> bool:
    """Whether a stream event carries output (a completion's text, a chat delta's content or
    tool call; not the opening role-only delta)."""
    try:
        choices = json.loads(data).get("choices") or []
    except (ValueError, AttributeError):
        return False
    for c in choices:
        delta = c.get("delta") or {}
        if c.get("text") or delta.get("content") or delta.get("tool_calls"):
            return True
    return False


def _set_cached(obj: dict, cached) -> None:
    usage = obj.get("usage")
    if cached is not None and isinstance(usage, dict):
        usage.setdefault("prompt_tokens_details", {})["cached_tokens"] = cached


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status
    )


def build_app(router: Router) -> FastAPI:
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="splitmoe router", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await router.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request):
        for inst in router.decode_order():
            try:
                r = await router.client.get(inst.url + "/v1/models", headers=_auth(request))
            except httpx.HTTPError:
                continue
            return Response(r.content, r.status_code, media_type="application/json")
        return _error(503, "no decode instance could be reached")

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(router.counters), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        async def ok(inst: Instance) -> bool:
            try:
                return (await router.client.get(inst.url + "/health")).status_code == 200
            except httpx.HTTPError:
                return False

        pre = await asyncio.gather(*(ok(i) for i in router.prefill))
        dec = await asyncio.gather(*(ok(i) for i in router.decode))
        body = {
            "status": "ok" if any(dec) else "unavailable",
            "prefill": dict(zip((i.url for i in router.prefill), pre)),
            "decode": dict(zip((i.url for i in router.decode), dec)),
            **router.counters,
        }
        return JSONResponse(body, 200 if any(dec) else 503)

    return app


def _auth(request: Request) -> dict:
    h = request.headers.get("authorization")
    return {"Authorization": h} if h else {}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m splitmoe.router",
        description="OpenAI-compatible router in front of prefill and decode instances",
    )
    ap.add_argument("--prefill", nargs="+", required=True, help="prefill instances' URLs")
    ap.add_argument("--decode", nargs="+", required=True, help="decode instances' URLs")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument(
        "--timeout", type=float, default=600.0, help="seconds an instance may take to answer"
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s router %(levelname)s %(message)s",
    )
    router = Router(args.prefill, args.decode, timeout_s=args.timeout)
    uvicorn.run(build_app(router), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
