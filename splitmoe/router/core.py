"""`Router`: one request's two stages (prefill, then decode) over the instances, each bounded
in time, with the parked blocks released whenever the decode side will not read them."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from splitmoe.kv_transfer.agent import AgentFault, Release, ask
from splitmoe.kv_transfer.auth import HEADER, sign
from splitmoe.router.instances import Instance, RouterMetrics, prefix_chunks
from splitmoe.router.upstream import (
    Disconnected,
    Handoff,
    error_response,
    handoff_of,
    has_token,
    maybe_off_loop,
    relayed_error,
    set_cached,
    sse_events,
    unless_disconnected,
)
from splitmoe.server.protocol import error_body

logger = logging.getLogger("splitmoe.router")

_LOAD_SLACK = 4  # a prefix hit wins unless its instance has this many more requests in flight
_RELEASE_TIMEOUT_S = 5.0  # telling a prefill instance's agents to release a transfer


@dataclass(frozen=True)
class Timeouts:
    """Seconds each stage may take (each a router flag)."""

    prefill: float = 60.0  # the prefill stage, per instance tried
    decode: float = 600.0  # a whole answer; a stream's longest silence
    connect: float = 5.0
    health: float = 1.0


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
    ) -> Handoff | Response | None:
        """Runs the prompts on a prefill instance: the handoff for the decode instance, or the
        client's own error (a `Response`), or None when no prefill instance could (the decode
        instance then computes the prompt)."""
        kv = {"transfer_id": transfer_id, "do_remote_decode": True}
        content, hdrs = self._signed({**body, "kv_transfer_params": kv}, headers)
        chunks = await maybe_off_loop(len(content), prefix_chunks, body)
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
                return relayed_error(r)
            handoff = handoff_of(r, transfer_id)
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

    async def release(self, handoff: Handoff | None) -> None:
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
            return error_response(400, "kv_transfer_params is set by the router, not by clients")
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
                r = await unless_disconnected(request, call, self.timeouts.decode)
            except (httpx.TransportError, TimeoutError) as e:
                inst.failures += 1
                logger.warning("decode instance %s failed (%r)", inst.url, e)
                if isinstance(e, TimeoutError):  # (it may be working on it: no second try)
                    await self.release(handoff)
                    return error_response(504, "the decode instance did not answer in time")
                continue
            except Disconnected:
                self.counters["client_disconnects"] += 1
                await self.release(handoff)
                return Response(status_code=499)
            finally:
                inst.inflight -= 1
            inst.answered()
            if r.status_code != 200:
                self.counters["decode_failures"] += 1
                await self.release(handoff)
                return relayed_error(r)
            try:
                out = r.json()
                set_cached(out, handoff)
            except (ValueError, AttributeError):
                await self.release(handoff)
                return error_response(502, "the decode instance gave a malformed answer")
            return JSONResponse(out)
        await self.release(handoff)
        return error_response(503, "no decode instance could be reached")

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
                return relayed_error(r, body)
            relay = self._relay(inst, r, handoff, times)
            return StreamingResponse(relay, media_type="text/event-stream")
        await self.release(handoff)
        return error_response(503, "no decode instance could be reached")

    async def _relay(
        self, inst: Instance, r: httpx.Response, handoff: Handoff | None, times: tuple
    ) -> AsyncIterator[str]:
        """The decode instance's events as they come (usage's cached tokens replaced), each
        checked; a failure, a malformed event or a silence past ``--decode-timeout`` ends the
        stream with an error event and ``[DONE]``. A client that leaves closes the upstream
        connection, which aborts the decode request. ``times``: when the request came and its
        prefill stage ended (`perf_counter`), for the first token's metrics."""
        done = first = False
        failure = None
        try:
            async for data in sse_events(r.aiter_bytes(), self.timeouts.decode):
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if not isinstance(obj, dict):
                    raise ValueError("an event that is not a JSON object")
                if not first and has_token(obj):
                    first = True
                    now = time.perf_counter()
                    self.metrics.ttft.observe(now - times[0])
                    self.metrics.decode_first.observe(now - times[1])
                if handoff is not None and "usage" in obj:
                    set_cached(obj, handoff)
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
