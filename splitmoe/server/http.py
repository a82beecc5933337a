"""ASGI pieces the HTTP edges share (the server, `splitmoe.serve`, and the prefill-decode
router, `splitmoe.router`)."""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse

from splitmoe.server.protocol import Limits, error_body


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is a 413, whether its
    Content-Length says so or it streams in chunks: the body is read here (at most ``limit``
    bytes are held) and handed on whole. A body that has not all come ``read_timeout`` seconds
    after its headers is a 408 (a client that sends a few bytes and stalls held a connection
    and its buffer for ever). Both close the connection: the rest of the body is not read."""

    def __init__(self, app, limit: int, read_timeout: float = Limits.request_read_timeout):
        self.app, self.limit, self.read_timeout = app, limit, read_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        too_big = length is not None and length.isdigit() and int(length) > self.limit
        chunks, seen, more = [], 0, not too_big
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:  # (Python 3.10's; the builtin one's alias since 3.11)
                message = (
                    f"the request body did not arrive within {self.read_timeout:g} s "
                    "(--request-read-timeout)"
                )
                return await closing(message, 408)(scope, receive, send)
            if message["type"] != "http.request":  # (the client left)
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            more = message.get("more_body", False)
            if seen > self.limit:
                too_big = True
                break
        if too_big:
            message = f"the request body is larger than {self.limit} bytes (--max-request-bytes)"
            return await closing(message, 413)(scope, receive, send)
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # (then only a disconnect comes)

        if scope["method"] == "POST":  # (every body here is JSON, whatever a client labels it:
            # `curl -d` says form-urlencoded)
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, replay, send)


def closing(message: str, status: int) -> JSONResponse:
    """An error response that closes the connection (a body left unread cannot be skipped)."""
    return JSONResponse(
        error_body(message, "invalid_request_error", status),
        status_code=status,
        headers={"connection": "close"},
    )
