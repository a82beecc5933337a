"""The front door's check of ``response_format`` JSON schemas: once per distinct schema, off the
event loop, within a time budget.

Turning a schema into xgrammar's grammar is the slow part of a structured request's admission,
and its time has no useful bound in the schema's size: ``{"type": "string", "pattern":
"[ab]{10000}"}`` (40 bytes) takes seconds, and the time grows with the square of the count. So:

* the checks that need no xgrammar (JSON, nesting, size: `grammar.canonical_schema`) run on a
  worker thread;
* the conversion runs in a child process (``python -m splitmoe.server.schema_check``), one
  schema at a time. A schema still converting after ``timeout_s`` is a 400 naming the limit,
  and the child is killed and started again for the next schema: a thread could not be stopped
  and would hold a core for as long as xgrammar takes (minutes, for a schema of many such
  patterns). A schema that crashes xgrammar ends the child, not the server, and is a 400;
* verdicts are kept by the schema text's digest, least recently used out (`CACHE_ENTRIES`): a
  schema is converted once however often it comes, and one refused for its time is refused at
  once when it comes again. Requests with the same schema at once share one conversion;
* a schema that cannot start its check within ``timeout_s`` (others hold the child) is a 503
  with Retry-After: the server is busy and did not judge it.

The attention rank compiles the schema again against the vocabulary (`GrammarBackend`), beside
its step loop; a schema reaches it only once it passed here.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import struct
import sys
from collections import OrderedDict
from pathlib import Path

from splitmoe.attention_nodes.grammar import canonical_schema, remember_accepted_schema
from splitmoe.server.protocol import BadRequest

SCHEMA_CHECK_TIMEOUT_S = 5.0  # xgrammar converts the schemas clients use in milliseconds
CACHE_ENTRIES = 4096  # verdicts kept (a 32-byte digest and a message each)
_START_TIMEOUT_S = 120.0  # the child's imports (xgrammar imports torch and transformers)
_FRAME = struct.Struct("<I")  # the byte length of each message between parent and child
_PARAM = "response_format"


class SchemaRefused(BadRequest):
    """A 400: the schema is not one the server can turn into a grammar (its message says why)."""

    def __init__(self, message: str):
        super().__init__(f"'response_format.json_schema.schema': {message}", _PARAM)


class SchemaBusy(Exception):
    """A 503: the schema checks are all taken; retry (``retry_after`` seconds)."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


_BUSY = object()  # (a verdict that is none: the check did not get its turn)


class SchemaChecker:
    """One per server (its event loop): `check` a schema; `start` ahead of the first one,
    `close` at the end."""

    def __init__(self, timeout_s: float = SCHEMA_CHECK_TIMEOUT_S, entries: int = CACHE_ENTRIES):
        if not timeout_s > 0 or entries < 1:
            raise ValueError(f"timeout_s {timeout_s} must be > 0 and entries {entries} >= 1")
        self.timeout_s, self.entries = timeout_s, entries
        self.conversions = 0  # schemas the child was asked to convert
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()  # None: accepted
        self._pending: dict[bytes, asyncio.Future] = {}  # checks under way, by digest
        self._turn = asyncio.Lock()  # (one schema in the child at a time)
        self._child: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        """Starts the child now rather than on the first schema (its imports take seconds)."""
        async with self._turn:
            await self._ready_child()

    async def close(self) -> None:
        await self._kill()

    async def check(self, schema: dict | str) -> str:
        """The schema's canonical text (what `SamplingParams.json_schema` takes), or
        `SchemaRefused` (400), or `SchemaBusy` (503)."""
        try:
            text = await asyncio.to_thread(canonical_schema, schema)
        except ValueError as e:
            raise SchemaRefused(str(e)) from None
        key = hashlib.sha256(text.encode()).digest()
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            verdict = self._verdicts[key]
        elif key in self._pending:
            verdict = await asyncio.shield(self._pending[key])
        else:
            shared = asyncio.get_running_loop().create_future()
            self._pending[key] = shared
            verdict = _BUSY
            try:
                verdict = await self._judge(text)
                if verdict is not _BUSY:
                    self._remember(key, verdict)
            finally:
                del self._pending[key]
                shared.set_result(verdict)
        if verdict is _BUSY:
            raise SchemaBusy(
                "the server is busy checking other JSON schemas; retry shortly",
                retry_after=max(1, round(self.timeout_s)),
            )
        if verdict is not None:
            raise SchemaRefused(verdict)
        remember_accepted_schema(text)  # (the request's own checks need not convert it again)
        return text

    def _remember(self, key: bytes, verdict: str | None) -> None:
        self._verdicts[key] = verdict
        while len(self._verdicts) > self.entries:
            self._verdicts.popitem(last=False)

    async def _judge(self, text: str):
        """None (accepted), an error message, or ``_BUSY``."""
        try:
            await asyncio.wait_for(self._turn.acquire(), self.timeout_s)
        except asyncio.TimeoutError:
            return _BUSY
        try:
            child = await self._ready_child()
            self.conversions += 1
            return await self._ask(child, text)
        finally:
            self._turn.release()

    async def _ask(self, child: asyncio.subprocess.Process, text: str) -> str | None:
        data = text.encode()
        try:
            child.stdin.write(_FRAME.pack(len(data)) + data)
            reply = await asyncio.wait_for(_read_reply(child), self.timeout_s)
        except asyncio.TimeoutError:
            await self._kill()
            return (
                f"converting it to a grammar took longer than {self.timeout_s:g} s "
                "(--schema-check-timeout); long repetitions in a 'pattern' (such as [ab]{10000}) "
                "are the usual cause"
            )
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            await self._kill()  # (the child died on this schema: xgrammar crashed)
            return "xgrammar failed on this schema"
        except BaseException:  # (cancelled mid-exchange: the child's next reply is this one's)
            await self._kill()
            raise
        return reply.get("error")

    async def _ready_child(self) -> asyncio.subprocess.Process:
        if self._child is not None and self._child.returncode is None:
            return self._child
        root = str(Path(__file__).resolve().parents[2])  # (where `splitmoe` is importable)
        path = os.environ.get("PYTHONPATH", "")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, path) if p)}
        self._child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "splitmoe.server.schema_check",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        try:
            hello = await asyncio.wait_for(_read_reply(self._child), _START_TIMEOUT_S)
        except BaseException:
            await self._kill()
            raise
        if hello.get("error"):
            await self._kill()
            raise SchemaRefused(f"structured output is unavailable: {hello['error']}")
        return self._child

    async def _kill(self) -> None:
        child, self._child = self._child, None
        if child is not None and child.returncode is None:
            child.kill()
            await child.wait()


async def _read_reply(child: asyncio.subprocess.Process) -> dict:
    (n,) = _FRAME.unpack(await child.stdout.readexactly(_FRAME.size))
    reply = json.loads(await child.stdout.readexactly(n))
    if not isinstance(reply, dict):
        raise ValueError(f"the schema checker replied {reply!r}")
    return reply


def main() -> None:
    """The child: schema texts in (stdin), ``{"error": message or null}`` out, each framed by
    its length. Its replies go out on a copy of its stdout; fd 1 itself is pointed at stderr,
    so that nothing a library prints mixes with them."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer

    def send(reply: dict) -> None:
        data = json.dumps(reply).encode()
        out.write(_FRAME.pack(len(data)) + data)
        out.flush()

    try:
        from splitmoe.attention_nodes.grammar import JSON_OBJECT_SCHEMA, convert_schema

        convert_schema(JSON_OBJECT_SCHEMA)  # (xgrammar imported now: not in a schema's time)
    except Exception as e:
        send({"error": f"xgrammar cannot be imported ({type(e).__name__}: {e})"})
        return
    send({"ready": True})
    while header := inp.read(_FRAME.size):
        (n,) = _FRAME.unpack(header)
        text = inp.read(n).decode()
        try:
            convert_schema(text)
            send({"error": None})
        except ValueError as e:
            send({"error": str(e)})


if __name__ == "__main__":
    main()
