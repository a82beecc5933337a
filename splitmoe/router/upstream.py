"""What the router reads from its instances, checked before it is used: a prefill answer's
handoff, a decode instance's server-sent events (each bounded in size and in the silence
before it), an error body; and the waits that a client's departure ends."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from splitmoe.kv_transfer import KVTransferParams
from splitmoe.server.protocol import error_body

_OFF_LOOP_BYTES = 64 << 10  # bodies larger than this are hashed on a worker thread
_MAX_EVENT_BYTES = 8 << 20  # one server-sent event from a decode instance, at most
_DISCONNECT_CHECK_S = 0.5  # how often a non-streamed request checks that its client is there


@dataclass
class Handoff:
    """What the prefill stage gave the decode stage."""

    params: dict  # the decode instance's kv_transfer_params
    cached: int  # the prompt tokens the prefill instance found cached
    agents: list[str]  # where to release the parked blocks


class Disconnected(Exception):
    """The client of a non-streamed request went away."""


async def unless_disconnected(request: Request, call: asyncio.Future, timeout: float):
    """``call``'s result, unless the client disconnects first (`Disconnected`) or ``timeout``
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
                raise Disconnected
    finally:
        if not call.done():
            call.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(call, return_exceptions=True)


async def sse_events(chunks: AsyncIterator[bytes], silence_s: float) -> AsyncIterator[str]:
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


async def maybe_off_loop(size: int, fn, *args):
    """``fn(*args)``, on a worker thread when the body is large (the event loop serves every
    other client meanwhile)."""
    if size > _OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def handoff_of(r: httpx.Response, transfer_id: str) -> Handoff | None:
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
    return Handoff(params, cached, list(agents))


def has_token(obj: dict) -> bool:
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


def set_cached(obj: dict, handoff: Handoff | None) -> None:
    usage = obj.get("usage")
    if handoff is not None and isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if not isinstance(details, dict):
            details = usage["prompt_tokens_details"] = {}
        details["cached_tokens"] = handoff.cached


def relayed_error(r: httpx.Response, content: bytes | None = None) -> Response:
    """An instance's error answer as the client's: as it came when it is OpenAI's error shape,
    else a 502 saying so (never a peer's stray text)."""
    content = r.content if content is None else content
    try:
        err = json.loads(content)["error"]
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return Response(content, r.status_code, media_type="application/json")
    except (ValueError, KeyError, TypeError):
        pass
    return error_response(502, f"an instance answered {r.status_code} without an error body")


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, kind, status, param), status)
