"""The prefill-decode router: the OpenAI API in front of prefill and decode instances.

``python -m splitmoe.router --prefill URL [URL ...] --decode URL [URL ...] --port P``

Each completion is checked at the door as the instances check it (the same pydantic schema,
the same body limit: a 400 or 413 before any instance works), then sent first to a prefill
instance as the client wrote it plus ``kv_transfer_params={"do_remote_decode": true, ...}``:
the prefill instance checks the whole request again (a request the decode side would refuse is
refused before its prompt is computed), computes each prompt once and parks its KV blocks for
the ``n`` readers, and answers with where they are (its KV agents, read at answer time, so a
restarted instance gives its new ones). Then the request goes to a decode instance with
``kv_transfer_params={"do_remote_prefill": true, "remote_agents": [...]}``: its ranks pull the
blocks and generate; the decode instance's answer (streamed or whole) is the client's, with
``usage.prompt_tokens_details.cached_tokens`` taken from the prefill instance. Every request
that carries ``kv_transfer_params`` is signed with the deployment's secret
(`splitmoe.kv_transfer.auth`): instances refuse them from anyone else.

The prefill instance is chosen by cached prefix (the prompts each instance was sent lately,
hashed in 64-character or 16-token chunks, off the event loop) and then by load (requests in
flight); the decode instance by load. Failures, each bounded in time:

* a prefill instance that cannot be reached, answers 5xx or nothing within
  ``--prefill-timeout`` is skipped for the next one, and one that failed is left out for a
  few seconds (`DOWN_S`); with none left the decode instance computes the prompt itself (it
  also does when its pull fails); an instance over its parked-KV cap (503) is skipped too;
* the decode instance refuses the request or fails, or the client disconnects (streaming or
  not): the decode request is aborted (its connection closed) and the prefill instance's
  parked blocks for it are released at once through its KV agents;
* a decode instance that cannot be reached is skipped; one that fails mid-stream, sends a
  malformed event or nothing for ``--decode-timeout`` ends the stream with an error event and
  ``data: [DONE]``;
* ``GET /health`` answers within ``--health-timeout`` and names the instances that did not.

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
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitmoe.kv_transfer import KVTransferParams
from splitmoe.kv_transfer.agent import AgentFault, Release, ask
from splitmoe.kv_transfer.auth import HEADER, require_secret, sign
from splitmoe.server.http import BodyLimit
from splitmoe.server.metrics import LATENCY_BUCKETS
from splitmoe.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Limits,
    error_body,
    validation_error,
)

logger = logging.getLogger("splitmoe.router")

_CHUNK_CHARS, _CHUNK_TOKENS = 64, 16  # prefix granularity of the router's cache guess
_PREFIXES_KEPT = 4096  # chunk digests remembered per prefill instance (LRU)
_LOAD_SLACK = 4  # a prefix hit wins unless its instance has this many more requests in flight
_OFF_LOOP_BYTES = 64 << 10  # bodies larger than this are hashed on a worker thread
_MAX_EVENT_BYTES = 8 << 20  # one server-sent event from a decode instance, at most
_RELEASE_TIMEOUT_S = 5.0  # telling a prefill instance's agents to release a transfer
_DISCONNECT_CHECK_S = 0.5  # how often a non-streamed request checks that its client is there
DOWN_S = 5.0  # a prefill instance that failed is left out this long (then tried again)


@dataclass
class Instance:
    """One splitmoe server the router sends to."""

    url: str
    inflight: int = 0
    failures: int = 0
    down_until: float = 0.0  # (time.monotonic) left out of the order until then
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

    def failed(self) -> None:
        self.failures += 1
        self.down_until = time.monotonic() + DOWN_S

    def answered(self) -> None:
        self.failures, self.down_until = 0, 0.0

    @property
    def down(self) -> bool:
        return time.monotonic() < self.down_until


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
            return Histogram(f"splitmoe:{name}", doc, buckets=LATENCY_BUCKETS, registry=r)

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


@dataclass(frozen=True)
class Timeouts:
    """Seconds each stage may take (each a router flag)."""

    prefill: float = 60.0  # the prefill stage, per instance tried
    decode: float = 600.0  # a whole answer; a stream's longest silence
    connect: float = 5.0
    health: float = 1.0


@dataclass
class _Handoff:
    """What the prefill stage gave the decode stage."""

    params: dict  # the decode instance's kv_transfer_params
    cached: int  # the prompt tokens the prefill instance found cached
    agents: list[str]  # where to release the parked blocks


class Router:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        secret: bytes,
        timeouts: Timeouts = Timeouts(),
    ):
        if not prefill or not decode:
            raise ValueError("the router needs at least one prefill and one decode instance")
        self.prefill = [Instance(u.rstrip("/")) for u in prefill]
        self.decode = [Instance(u.rstrip("/")) for u in decode]
        self.secret = secret
        self.timeouts = timeouts
        self.client: httpx.AsyncClient | None = None
        self.counters = {
            "requests": 0,
            "prefill_retries": 0,
            "prefill_fallbacks": 0,
            "decode_failures": 0,
            "released_early": 0,
            "client_disconnects": 0,
        }
        self.metrics = RouterMetrics()

    async def start(self) -> None:
        t = self.timeouts
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(t.decode, connect=t.connect),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    # ---- choosing ------------------------------------------------------------------------------

    def prefill_order(self, chunks: list[bytes]) -> list[Instance]:
        """Prefill instances best first, those that failed lately left out: the longest cached
        prefix among those within `_LOAD_SLACK` of the least loaded, then the least loaded."""
        live = [i for i in self.prefill if not i.down]
        if not live:
            return []
        least = min(i.inflight for i in live)

        def key(inst: Instance):
            hit = inst.matched(chunks) if inst.inflight <= least + _LOAD_SLACK else 0
            return (-hit, inst.inflight)

        return sorted(live, key=key)

    def decode_order(self) -> list[Instance]:
        return sorted(self.decode, key=lambda i: (i.failures > 0, i.inflight))

    def _signed(self, body: dict, headers: dict) -> tuple[bytes, dict]:
        content = json.dumps(body).encode()
        out = {**headers, "Content-Type": "application/json"}
        if "kv_transfer_params" in body:
            out[HEADER] = sign(self.secret, content)
        return content, out

    # ---- one request ---------------------------------------------------------------------------

    async def prefill_step(
        self, path: str, body: dict, headers: dict, transfer_id: str
    ) -> _Handoff | Response | None:
        """Runs the prompts on a prefill instance: the handoff for the decode instance, or the
        client's own error (a `Response`), or None when no prefill instance could (the decode
        instance then computes the prompt)."""
        kv = {"transfer_id": transfer_id, "do_remote_decode": True}
        content, hdrs = self._signed({**body, "kv_transfer_params": kv}, headers)
        chunks = await _maybe_off_loop(len(content), prefix_chunks, body)
        for attempt, inst in enumerate(self.prefill_order(chunks)):
            if attempt:
                self.counters["prefill_retries"] += 1
            inst.inflight += 1
            try:
                r = await asyncio.wait_for(
                    self.client.post(inst.url + path, content=content, headers=hdrs),
                    self.timeouts.prefill,
                )
            except (httpx.HTTPError, TimeoutError) as e:
                inst.failed()
                logger.warning("prefill instance %s failed (%r); trying the next", inst.url, e)
                continue
            finally:
                inst.inflight -= 1
            if r.status_code == 503:  # (busy: over its parked-KV cap or its queue)
                continue
            if r.status_code == 403 or r.status_code >= 500:
                inst.failed()
                if r.status_code == 403:
                    logger.error(
                        "prefill instance %s refused the router's signature: give the router "
                        "and every instance the same SPLITMOE_KV_SECRET",
                        inst.url,
                    )
                continue
            if r.status_code >= 400:  # the client's request: said as the instance says it
                return _relayed_error(r)
            handoff = _handoff_of(r, transfer_id)
            if handoff is None:
                inst.failed()
                logger.warning("prefill instance %s gave a malformed answer", inst.url)
                continue
            inst.answered()
            inst.remember(chunks)
            return handoff
        self.counters["prefill_fallbacks"] += 1
        logger.warning("no prefill instance answered; the decode instance computes the prompt")
        return None

    async def release(self, handoff: _Handoff | None) -> None:
        """Tells the prefill instance to free the transfer's parked blocks now (the decode side
        will not read them); failures are left to its timeout."""
        if handoff is None:
            return
        self.counters["released_early"] += 1
        tid = handoff.params["transfer_id"]

        def tell(agent: str) -> None:
            try:
                ask(agent, Release(tid), self.secret, time.monotonic() + _RELEASE_TIMEOUT_S)
            except AgentFault as e:
                logger.info("releasing transfer %s at %s failed (%s)", tid, agent, e)

        await asyncio.gather(*(asyncio.to_thread(tell, a) for a in handoff.agents))

    async def handle(self, path: str, request: Request, body: dict) -> Response:
        if "kv_transfer_params" in body:
            return _error(400, "kv_transfer_params is set by the router, not by clients")
        self.counters["requests"] += 1
        headers = {}
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        t0 = time.perf_counter()
        handoff = await self.prefill_step(path, body, headers, uuid.uuid4().hex)
        if isinstance(handoff, Response):
            return handoff
        t1 = time.perf_counter()
        if handoff is not None:
            self.metrics.prefill.observe(t1 - t0)
        dec = dict(body)
        if handoff is not None:
            dec["kv_transfer_params"] = handoff.params
        content, hdrs = self._signed(dec, headers)
        if body.get("stream"):
            return await self._stream(request, path, content, hdrs, handoff, (t0, t1))
        return await self._whole(request, path, content, hdrs, handoff)

    async def _whole(self, request: Request, path, content, headers, handoff) -> Response:
        for inst in self.decode_order():
            inst.inflight += 1
            call = asyncio.ensure_future(
                self.client.post(inst.url + path, content=content, headers=headers)
            )
            try:
                r = await _unless_disconnected(request, call, self.timeouts.decode)
            except (httpx.TransportError, TimeoutError) as e:
                inst.failures += 1
                logger.warning("decode instance %s failed (%r)", inst.url, e)
                if isinstance(e, TimeoutError):  # (it may be working on it: no second try)
                    await self.release(handoff)
                    return _error(504, "the decode instance did not answer in time")
                continue
            except _Disconnected:
                self.counters["client_disconnects"] += 1
                await self.release(handoff)
                return Response(status_code=499)
            finally:
                inst.inflight -= 1
            inst.answered()
            if r.status_code != 200:
                self.counters["decode_failures"] += 1
                await self.release(handoff)
                return _relayed_error(r)
            try:
                out = r.json()
                _set_cached(out, handoff)
            except (ValueError, AttributeError):
                await self.release(handoff)
                return _error(502, "the decode instance gave a malformed answer")
            return JSONResponse(out)
        await self.release(handoff)
        return _error(503, "no decode instance could be reached")

    async def _stream(self, request: Request, path, content, headers, handoff, times) -> Response:
        for inst in self.decode_order():
            inst.inflight += 1
            try:
                req = self.client.build_request(
                    "POST", inst.url + path, content=content, headers=headers
                )
                r = await self.client.send(req, stream=True)
            except httpx.HTTPError as e:
                inst.inflight -= 1
                inst.failures += 1
                logger.warning("decode instance %s failed (%r)", inst.url, e)
                continue
            inst.answered()
            if r.status_code != 200:
                try:
                    body = await r.aread()
                except httpx.HTTPError:
                    body = b""
                await r.aclose()
                inst.inflight -= 1
                self.counters["decode_failures"] += 1
                await self.release(handoff)
                return _relayed_error(r, body)
            relay = self._relay(inst, r, handoff, times)
            return StreamingResponse(relay, media_type="text/event-stream")
        await self.release(handoff)
        return _error(503, "no decode instance could be reached")

    async def _relay(
        self, inst: Instance, r: httpx.Response, handoff: _Handoff | None, times: tuple
    ) -> AsyncIterator[str]:
        """The decode instance's events as they come (usage's cached tokens replaced), each
        checked; a failure, a malformed event or a silence past ``--decode-timeout`` ends the
        stream with an error event and ``[DONE]``. A client that leaves closes the upstream
        connection, which aborts the decode request. ``times``: when the request came and its
        prefill stage ended (`perf_counter`), for the first token's metrics."""
        done = first = False
        failure = None
        try:
            async for data in _events(r.aiter_bytes(), self.timeouts.decode):
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if not isinstance(obj, dict):
                    raise ValueError("an event that is not a JSON object")
                if not first and _has_token(obj):
                    first = True
                    now = time.perf_counter()
                    self.metrics.ttft.observe(now - times[0])
                    self.metrics.decode_first.observe(now - times[1])
                if handoff is not None and "usage" in obj:
                    _set_cached(obj, handoff)
                    data = json.dumps(obj)
                yield f"data: {data}\n\n"
        except (httpx.HTTPError, TimeoutError, ValueError, RecursionError) as e:
            failure = e
            logger.warning("decode instance %s failed mid-stream (%r)", inst.url, e)
        finally:
            inst.inflight -= 1
            with anyio.CancelScope(shield=True):  # (runs also when the client left)
                await r.aclose()
                if not done:
                    await self.release(handoff)
        if not done:
            self.counters["decode_failures"] += 1
            reason = "sent a malformed event" if isinstance(failure, ValueError) else "failed"
            err = error_body(f"the decode instance {reason}", "server_error", 502)
            yield f"data: {json.dumps(err)}\n\n"
        yield "data: [DONE]\n\n"

    async def health(self) -> tuple[dict, int]:
        """Every instance's ``/health``, each within ``--health-timeout``."""
        limit = self.timeouts.health

        async def ok(inst: Instance) -> bool:
            try:
                r = await asyncio.wait_for(self.client.get(inst.url + "/health"), limit)
                return r.status_code == 200
            except (httpx.HTTPError, TimeoutError):
                return False

        pre = await asyncio.gather(*(ok(i) for i in self.prefill))
        dec = await asyncio.gather(*(ok(i) for i in self.decode))
        silent = [i.url for i, good in zip([*self.prefill, *self.decode], [*pre, *dec]) if not good]
        body = {
            "status": "ok" if any(dec) else "unavailable",
            "prefill": dict(zip((i.url for i in self.prefill), pre)),
            "decode": dict(zip((i.url for i in self.decode), dec)),
            "not_answering": silent,
            **self.counters,
        }
        return body, 200 if any(dec) else 503


class _Disconnected(Exception):
    """The client of a non-streamed request went away."""


async def _unless_disconnected(request: Request, call: asyncio.Future, timeout: float):
    """``call``'s result, unless the client disconnects first (`_Disconnected`) or ``timeout``
    passes (TimeoutError); either way ``call`` is cancelled, which closes its connection."""
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            done, _ = await asyncio.wait({call}, timeout=min(left, _DISCONNECT_CHECK_S))
            if done:
                return call.result()
            if await request.is_disconnected():
                raise _Disconnected
    finally:
        if not call.done():
            call.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(call, return_exceptions=True)


async def _events(chunks: AsyncIterator[bytes], silence_s: float) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent event stream, each line bounded by
    `_MAX_EVENT_BYTES` (a ValueError beyond) and each wait by ``silence_s`` (TimeoutError)."""
    buf = bytearray()
    it = chunks.__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(it.__anext__(), silence_s)
        except StopAsyncIteration:
            return
        buf += chunk
        while True:
            end = buf.find(b"\n")
            if end < 0:
                break
            line = bytes(buf[:end]).rstrip(b"\r")
            del buf[: end + 1]
            if line.startswith(b"data: "):
                yield line[6:].decode("utf-8")
        if len(buf) > _MAX_EVENT_BYTES:
            raise ValueError(f"an event longer than {_MAX_EVENT_BYTES} bytes")


async def _maybe_off_loop(size: int, fn, *args):
    """``fn(*args)``, on a worker thread when the body is large (the event loop serves every
    other client meanwhile)."""
    if size > _OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _handoff_of(r: httpx.Response, transfer_id: str) -> _Handoff | None:
    """The decode side's parameters from a prefill answer, checked; None when malformed."""
    try:
        out = r.json()
        kv = out["kv_transfer_params"]
        agents = kv["remote_agents"]
        if kv.get("transfer_id") != transfer_id or not isinstance(agents, list) or not agents:
            return None
        KVTransferParams(transfer_id, do_remote_prefill=True, remote_agents=tuple(agents))
        usage = out.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if not isinstance(cached, int):
            cached = 0
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    params = {"transfer_id": transfer_id, "do_remote_prefill": True, "remote_agents": agents}
    return _Handoff(params, cached, list(agents))


def _has_token(obj: dict) -> bool:
    """Whether a stream event carries output (a completion's text, a chat delta's content or
    tool call; not the opening role-only delta)."""
    choices = obj.get("choices")
    for c in choices if isinstance(choices, list) else ():
        if not isinstance(c, dict):
            continue
        delta = c.get("delta") if isinstance(c.get("delta"), dict) else {}
        if c.get("text") or delta.get("content") or delta.get("tool_calls"):
            return True
    return False


def _set_cached(obj: dict, handoff: _Handoff | None) -> None:
    usage = obj.get("usage")
    if handoff is not None and isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if not isinstance(details, dict):
            details = usage["prompt_tokens_details"] = {}
        details["cached_tokens"] = handoff.cached


def _relayed_error(r: httpx.Response, content: bytes | None = None) -> Response:
    """An instance's error answer as the client's: as it came when it is OpenAI's error shape,
    else a 502 saying so (never a peer's stray text)."""
    content = r.content if content is None else content
    try:
        err = json.loads(content)["error"]
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return Response(content, r.status_code, media_type="application/json")
    except (ValueError, KeyError, TypeError):
        pass
    return _error(502, f"an instance answered {r.status_code} without an error body")


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, kind, status, param), status)


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
        return _error(400, str(err), getattr(err, "param", None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = {404: "no such endpoint", 405: "method not allowed here"}.get(
            exc.status_code, str(exc.detail)
        )
        return _error(exc.status_code, f"{message}: {request.method} {request.url.path}")

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
            return _relayed_error(r)
        return _error(503, "no decode instance could be reached")

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


if __name__ == "__main__":
    raise SystemExit(main())
