"""The router's view of its instances: load, failures, the prompts each was sent lately
(`prefix_chunks`), and its ``/metrics``."""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from splitmoe.server.metrics import LATENCY_BUCKETS

_CHUNK_CHARS, _CHUNK_TOKENS = 64, 16  # prefix granularity of the router's cache guess
_PREFIXES_KEPT = 4096  # chunk digests remembered per prefill instance (LRU)
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
