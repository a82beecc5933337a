"""The prefill-decode path as an edge (issue 65): what clients, the router and broken peers
may and may not do to the instances. One prefill (1+0) and one decode instance (1+0) on CPU,
Mooncake over TCP, the router in front; one ``kv_role="both"`` instance is the oracle."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

pytest.importorskip("mooncake.engine")

from pd.pd_setup import (  # noqa: E402
    MOONCAKE,
    NAME,
    Router,
    completion,
    kv_state,
    near_tie,
    signed,
    wait_all_free,
)
from pd.test_agent import GARBAGE, FakeAgent  # noqa: E402
from server.server_proc import Server, descendants  # noqa: E402
from tiny_models import prompt_ids  # noqa: E402

from splitmoe.kv_transfer.auth import HEADER  # noqa: E402

PREFILL = ("--attention-ranks", "1", "--kv-role", "prefill", *MOONCAKE, *NAME)
# (four sequences at a time: a request of many copies decodes in waves, long enough to leave)
DECODE = ("--attention-ranks", "1", "--kv-role", "decode", "--max-num-seqs", "4", *MOONCAKE, *NAME)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("qwen3_moe")


@pytest.fixture(scope="module")
def pd(ckpt):
    flags = [PREFILL, (*DECODE, "--max-stop-strings", "1"), ("--attention-ranks", "1", *NAME)]
    with ThreadPoolExecutor(3) as pool:
        starts = [pool.submit(Server, ckpt, *f) for f in flags]
    servers = [f.result() for f in starts if f.exception() is None]
    router = None
    try:
        if len(servers) < len(starts):
            raise next(f.exception() for f in starts if f.exception() is not None)
        router = Router([servers[0].url], [servers[1].url], "--max-request-bytes", "200000")
        yield (*servers, router)
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()


def oracle(both: Server):
    return openai.OpenAI(base_url=both.url + "/v1", api_key="x", max_retries=0, timeout=90)


def parked(server: Server) -> int:
    return sum(r.get("kv_parked", 0) for r in kv_state(server)["ranks"])


def transfers(server: Server) -> tuple[int, int]:
    ranks = kv_state(server)["ranks"]
    return (
        sum(r.get("kv_transfers", 0) for r in ranks),
        sum(r.get("kv_transfer_failures", 0) for r in ranks),
    )


def test_duplicate_prompts_and_copies_each_read_their_own_blocks(pd):
    """Twice the same prompt in one request, ``n`` copies of each: every copy gets one
    instance's text, and every parked block is free again as soon as they are done (not at
    the transfer timeout, 30 s: an entry nobody read would wait for it)."""
    prefill, decode, both, router = pd
    p, q = prompt_ids(21, seed=31), prompt_ids(9, seed=32)
    body = dict(prompt=[p, p, q], n=2, max_tokens=6, temperature=0, logprobs=2)
    want = oracle(both).completions.create(model="m", **body)
    before = transfers(decode)
    got = router.client().completions.create(model="m", **body)
    assert len(got.choices) == 6
    for w, g in zip(want.choices, got.choices):
        if g.text != w.text:  # (float32 near-ties may go either way, see `near_tie`)
            assert near_tie(type("R", (), {"choices": [w]}), type("R", (), {"choices": [g]})), (
                w.text,
                g.text,
            )
    wait_all_free(prefill, decode, timeout=5)
    pulled, failed = transfers(decode)
    assert (pulled - before[0], failed - before[1]) == (6, 0)  # every copy read its blocks


def test_best_of_and_every_field_reach_both_stages(pd):
    prefill, decode, both, router = pd
    p = prompt_ids(17, seed=41)
    body = dict(prompt=p, n=2, best_of=2, max_tokens=5, temperature=0, extra_body={"min_tokens": 2})
    want = oracle(both).completions.create(model="m", **body)
    got = router.client().completions.create(model="m", **body)
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    # the prefill instance checks the request as sent: refused before its prompt is computed
    computed = prefill.metrics()["splitmoe:time_to_first_token_seconds_count"]
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        router.client().completions.create(
            model="m", prompt=p, max_tokens=3, extra_body={"min_tokens": 9}
        )
    assert prefill.metrics()["splitmoe:time_to_first_token_seconds_count"] == computed
    assert parked(prefill) == 0


def test_a_refusal_by_the_decode_instance_releases_the_parked_blocks_at_once(pd):
    prefill, decode, _, router = pd
    with pytest.raises(openai.BadRequestError, match="max-stop-strings"):
        router.client().completions.create(
            model="m", prompt=prompt_ids(30, seed=5), max_tokens=4, stop=["ab", "cd"]
        )
    wait_all_free(prefill, timeout=3)  # (not the 30 s transfer timeout)
    assert router_event(router, "released_early") >= 1


def router_event(router: Router, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(router.url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "splitmoe:router_events" and s.labels.get("event") == name:
                return s.value
    return 0.0


def aborted(server: Server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "splitmoe:request_success_total" and s.labels.get("finished_reason") == "abort"
    )


def running(server: Server) -> float:
    return server.metrics().get("splitmoe:num_requests_running", 0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_aborts_the_decode_request(pd, stream):
    prefill, decode, _, router = pd
    before = aborted(decode)
    body = json.dumps(
        dict(
            model="m",
            prompt=prompt_ids(40, seed=7),
            max_tokens=200,
            n=16,  # (decoding long enough to be caught at it)
            ignore_eos=True,
            temperature=0,
            stream=stream,
        )
    ).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    s = socket.create_connection(("127.0.0.1", router.port), timeout=30)
    s.sendall(request)
    deadline = time.monotonic() + 30
    if stream:  # the first token came: then hang up
        seen = b""
        while b"data: {" not in seen:
            seen += s.recv(1 << 16)
    else:  # the decode instance works on it: then hang up
        while running(decode) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    s.close()
    while aborted(decode) == before:
        assert time.monotonic() < deadline, "the decode request ran on"
        time.sleep(0.1)
    wait_all_free(prefill, decode, timeout=5)


def test_the_router_limits_bodies_and_refuses_clients_kv_params(pd):
    router = pd[3]
    big = {"model": "m", "prompt": "x" * 300_000, "max_tokens": 1}
    r = httpx.post(router.url + "/v1/completions", json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    r = httpx.post(
        router.url + "/v1/completions",
        json={"prompt": [1, 2], "kv_transfer_params": {"transfer_id": "t"}},
        timeout=30,
    )
    assert r.status_code == 400 and "kv_transfer_params" in r.json()["error"]["message"]
    r = httpx.post(router.url + "/v1/completions", json={"prompt": [1], "n": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # (checked at the door)


def test_only_the_router_steers_transfers(pd):
    """``kv_transfer_params`` and ``/internal/kv`` without the router's signature are a 403
    (OpenAI's error shape) before any work; an instance without a connector refuses them
    whatever the signature."""
    prefill, decode, both, _ = pd
    park = {"transfer_id": "t", "do_remote_decode": True, "num_readers": 1024}
    pull = {"transfer_id": "t", "do_remote_prefill": True, "remote_agents": ["127.0.0.1:9"]}
    for server, kv in ((prefill, park), (decode, pull), (both, park)):
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 1, "kv_transfer_params": kv})
        for headers in ({}, {HEADER: "1.0.abc"}, signed(b"another body")):
            r = httpx.post(
                server.url + "/v1/completions",
                content=body,
                headers={**headers, "Content-Type": "application/json"},
                timeout=30,
            )
            assert r.status_code == 403, (server.url, r.text)
            err = r.json()["error"]
            assert err["code"] == 403 and err["param"] == "kv_transfer_params"
    for server in (prefill, decode, both):
        r = httpx.get(server.url + "/internal/kv", timeout=10)
        assert r.status_code == 403 and "agent" not in r.text
    r = httpx.get(both.url + "/internal/kv", headers=signed(b"/internal/kv"), timeout=10)
    assert r.status_code == 403  # (no connector, no secret: nothing is the router's)
    assert parked(prefill) == 0
    assert kv_state(prefill)["instance_id"] != kv_state(decode)["instance_id"]


@pytest.mark.parametrize("kind", ["banner", "json list", "json number", "unsigned lease"])
def test_a_garbage_agent_reply_leaves_the_decode_instance_serving(pd, kind):
    """A stale agent port reused by another service, or a listener that prints a banner: the
    request it was to serve computes its prompt on the decode instance, same text."""
    _, decode, both, _ = pd
    fake = FakeAgent(GARBAGE[kind])
    p = prompt_ids(19, seed=61)
    kv = {"transfer_id": "g", "do_remote_prefill": True, "remote_agents": [fake.address]}
    body = json.dumps(dict(prompt=p, max_tokens=6, temperature=0, kv_transfer_params=kv))
    try:
        r = httpx.post(
            decode.url + "/v1/completions",
            content=body,
            headers={**signed(body.encode()), "Content-Type": "application/json"},
            timeout=60,
        )
    finally:
        fake.close()
    assert r.status_code == 200, r.text
    want = completion(oracle(both), p, max_tokens=6)
    assert r.json()["choices"][0]["text"] == want.choices[0].text
    assert httpx.get(decode.url + "/health", timeout=10).json()["status"] == "ok"


class _FakeDecode(BaseHTTPRequestHandler):
    """An upstream that answers a stream with one good event, then ``self.server.tail``."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        event = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "a"}]}
        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode() + self.server.tail)
        self.wfile.flush()
        if self.server.hold:
            time.sleep(self.server.hold)

    def do_GET(self):
        self.send_response(503)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    "tail,hold",
    [
        (b"data: {not json\n\n", 0),
        (b"data: [1, 2]\n\n", 0),
        (b"", 0),  # (the connection closes without [DONE])
        (b"", 8),  # (silent past --decode-timeout)
    ],
)
def test_a_malformed_or_silent_upstream_stream_ends_with_an_error_and_done(tail, hold):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeDecode)
    server.tail, server.hold = tail, hold
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    router = Router([url], [url], "--decode-timeout", "2", "--prefill-timeout", "2")
    try:
        t0 = time.monotonic()
        with httpx.stream(
            "POST",
            router.url + "/v1/completions",
            json={"prompt": [1, 2], "max_tokens": 3, "stream": True},
            timeout=30,
        ) as r:
            lines = [x for x in r.iter_lines() if x]
        assert time.monotonic() - t0 < 6
        assert lines[0].startswith("data: {") and '"a"' in lines[0]
        assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]", lines
        assert httpx.get(router.url + "/health", timeout=10).status_code == 503  # (fake's 503)
    finally:
        router.stop()
        server.shutdown()


def _signal_all(server: Server, sig: int) -> None:
    for pid in [server.proc.pid, *descendants(server.proc.pid)]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def test_a_stopped_then_restarted_prefill_instance(pd, ckpt):
    """A SIGSTOPped prefill instance holds no request past ``--prefill-timeout`` (the decode
    instance computes the prompts) and ``/health`` names it within ``--health-timeout``; once
    it is back, and after a restart on the same port with new KV agents, prompts are pulled
    from it again."""
    _, decode, both, _ = pd
    victim = Server(ckpt, *PREFILL)
    router = Router([victim.url], [decode.url], "--prefill-timeout", "2", "--health-timeout", "0.5")
    try:
        client = router.client()
        prompts = [prompt_ids(12 + i, seed=80 + i) for i in range(4)]
        want = [completion(oracle(both), p).choices[0].text for p in prompts]
        _signal_all(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: completion(client, p).choices[0].text, prompts))
        assert got == want and time.monotonic() - t0 < 2 + 20
        t0 = time.monotonic()
        health = httpx.get(router.url + "/health", timeout=10).json()
        assert time.monotonic() - t0 < 2 and health["not_answering"] == [victim.url]
        _signal_all(victim, signal.SIGCONT)
        port = victim.port
        victim.stop()
        victim = Server(ckpt, *PREFILL, port=port)  # new KV agents, same URL
        completion(oracle(victim), prompts[0], max_tokens=1)  # (its first request: slower)
        time.sleep(5)  # (a prefill instance that failed is left out for `router.DOWN_S`)
        before = transfers(decode)
        for p, w in zip(prompts, want):
            assert completion(client, p).choices[0].text == w
        deadline = time.monotonic() + 10
        while transfers(decode)[0] - before[0] < len(prompts):  # (counters lag ~1 s)
            assert time.monotonic() < deadline, (before, transfers(decode))
            time.sleep(0.3)
        assert transfers(decode)[1] == before[1]  # pulled from the new agents, none failed
    finally:
        _signal_all(victim, signal.SIGCONT)
        router.stop()
        victim.stop()
