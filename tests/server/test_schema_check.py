"""The front door's JSON-schema checks (`splitmoe.server.schema_check`): once per distinct
schema, in a process of their own, within a time budget, the event loop free meanwhile.

Before, xgrammar converted ``response_format`` schemas on the event loop, once per sequence and
uncached: ``{"type": "string", "pattern": "(a|b){3000}"}`` stalled every client for ~1.2 s
times ``n``, and nothing bounded it (``[ab]{12000}``: ~10 s; a schema of many such patterns,
minutes).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from splitmoe.server.schema_check import SchemaBusy, SchemaChecker, SchemaRefused

BUDGET_S = 0.5
SLOW = {"type": "string", "pattern": "[ab]{12000}"}  # (~10 s to convert on a 2-core CPU)


async def _ticks(stop: asyncio.Event) -> list[float]:
    """The event loop's lateness, sampled every 10 ms until ``stop``."""
    late = []
    while not stop.is_set():
        t = time.monotonic()
        await asyncio.sleep(0.01)
        late.append(time.monotonic() - t - 0.01)
    return late


def test_each_schema_is_judged_once_within_its_budget():
    async def run():
        checker = SchemaChecker(timeout_s=BUDGET_S)
        await checker.start()
        try:
            # accepted: canonical text, converted once for requests at once and again later
            schema = {"type": "object", "properties": {"a": {}}}
            text = '{"type":"object","properties":{"a":{}}}'
            at_once = await asyncio.gather(*(checker.check(schema) for _ in range(5)))
            assert at_once == [text] * 5 and checker.conversions == 1
            assert await checker.check(text) == text and checker.conversions == 1
            # refused by xgrammar: a 400 naming the field, remembered
            for _ in range(2):
                with pytest.raises(SchemaRefused, match="unsupported JSON schema") as e:
                    await checker.check({"type": "nonsense"})
                assert e.value.param == "response_format"
            assert checker.conversions == 2
            # refused before xgrammar sees it: too deep
            deep: dict = {"type": "object"}
            for _ in range(100):
                deep = {"type": "array", "items": deep}
            with pytest.raises(SchemaRefused, match="deeper"):
                await checker.check(deep)
            assert checker.conversions == 2
            # too slow: refused at the budget, the loop free meanwhile; refused at once after
            stop = asyncio.Event()
            ticker = asyncio.create_task(_ticks(stop))
            t = time.monotonic()
            with pytest.raises(SchemaRefused, match="--schema-check-timeout"):
                await checker.check(SLOW)
            took = time.monotonic() - t
            stop.set()
            late = await ticker
            assert BUDGET_S <= took < BUDGET_S + 3, took
            assert max(late) < 0.25, max(late)
            t = time.monotonic()
            with pytest.raises(SchemaRefused, match="--schema-check-timeout"):
                await checker.check(SLOW)
            assert time.monotonic() - t < 0.2 and checker.conversions == 3
            # the killed child is replaced for the next schema
            assert await checker.check({"type": "integer"}) == '{"type":"integer"}'
        finally:
            await checker.close()

    asyncio.run(run())


def test_a_schema_that_cannot_get_its_turn_is_busy():
    """While the checker's process is taken for longer than a budget (another schema converting:
    here the test holds it), a schema that waited that long for its turn is a 503 with
    Retry-After, not judged (nothing remembered), and judged when asked again."""

    async def run():
        checker = SchemaChecker(timeout_s=BUDGET_S)
        await checker.start()
        try:
            async with checker._turn:
                t = time.monotonic()
                with pytest.raises(SchemaBusy) as e:
                    await checker.check({"type": "boolean"})
                assert BUDGET_S <= time.monotonic() - t < BUDGET_S + 1
                assert e.value.retry_after >= 1 and checker.conversions == 0
            assert await checker.check({"type": "boolean"}) == '{"type":"boolean"}'
        finally:
            await checker.close()

    asyncio.run(run())
