"""ASGI pieces the HTTP edges share (the server, `splitmoe.serve`, and the prefill-decode
router, `splitmoe.router`)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from splitmoe.server.protocol import error_body


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is a 413, whether its
    Content-Length says so or it streams in chunks: the body is read here (at most ``limit``
    bytes are held) and handed on whole."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        too_big = length is not None and length.isdigit() and int(length) > self.limit
        chunks, seen, more = [], 0, not too_big
        while more:
            message = await receive()
            if message["type"] != "http.request":  # (the client left)
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            more = message.get("more_body", False)
            if seen > self.limit:
                too_big = True
                break
        if too_big:
            response = JSONResponse(
                error_body(
                    f"the request body is larger than {self.limit} bytes (--max-request-bytes)",
                    "invalid_request_error",
                    413,
                ),
                status_code=413,
            )
            return await response(scope, receive, send)
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
