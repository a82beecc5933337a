"""The server's newest surfaces against an unfriendly client (issue 65, item 6): a JSON schema
that is slow to turn into a grammar pauses neither the event loop nor the rank's steps; a
whole-vocabulary ``logit_bias``, tool-call arguments nested 100,000 deep and a full queue are
refused with a 4xx/503 that says why; no response holds a path of the host; a client that sends
a few bytes of a body, or of its headers, and stalls is cut off at the read deadline while
everyone else is served.

One server (tiny Qwen3-MoE with a 4096-token context, colocated, no ``--served-model-name``)
serves the module.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time

import httpx
import pytest
from server_proc import Server
from tiny_models import prompt_ids

from splitmoe.serve import build_parser
from splitmoe.server.protocol import BadRequest, CompletionRequest, Limits, sampling

READ_TIMEOUT_S = 2.0  # --request-read-timeout and --header-read-timeout
MAX_SEQS = 4
MAX_QUEUED = 2
MAX_BIAS = 64  # --max-logit-bias: under the tiny vocabulary's 128 tokens
# xgrammar converts it in ~2 s and compiles it against the vocabulary in ~2 s more (2-core CPU,
# unloaded). Before, the event loop converted it twice and the rank's step loop twice more and
# compiled it: /health took 8.8 s and the stream paused 6.3-6.8 s (load ~10); now 0.2-0.9 s
# and 0.2-1.1 s.
SLOW_SCHEMA = {"type": "string", "pattern": "(a|b){4000}"}


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    # (a long context: long greedy streams, a step apart, run through the slow schema's checks)
    return tiny_ckpt("qwen3_moe", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(ckpt):
    srv = Server(
        ckpt,
        *("--max-num-seqs", str(MAX_SEQS), "--max-queued-requests", str(MAX_QUEUED)),
        *("--max-logit-bias", str(MAX_BIAS), "--schema-check-timeout", "60"),
        *("--request-read-timeout", str(READ_TIMEOUT_S)),
        *("--header-read-timeout", str(READ_TIMEOUT_S)),
    )
    yield srv
    srv.stop()


def _post(server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _served(server) -> None:
    r = _post(server, {"prompt": [7, 8], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


class _Stream(threading.Thread):
    """Greedy completion streams, one after the other until ``stop``, read on a thread: the
    arrival time of each chunk."""

    def __init__(self, server):
        super().__init__(daemon=True)
        self.url = server.url
        self.times: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        body = {
            "prompt": prompt_ids(5, seed=1),
            "max_tokens": 4000,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        while not self.stop.is_set():
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if self.stop.is_set():
                        return
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.times.append(time.monotonic())


def _health_times(server, until) -> list[float]:
    """/health's answer times, asked every 0.1 s until ``until()`` (inf: none within 10 s)."""
    times = []
    while not until():
        t = time.monotonic()
        try:
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            times.append(time.monotonic() - t)
        except httpx.TimeoutException:
            times.append(float("inf"))
        time.sleep(0.1)
    return times


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def test_a_slow_schema_pauses_neither_health_nor_a_running_stream(server):
    """The schema is checked in its own process and compiled beside the rank's step loop: while
    it is, /health answers within 1 s and the running stream's chunks keep coming. Before, the
    event loop converted it twice and the rank's step compiled it: pauses of seconds. (Both
    bounds also allow three times what this machine showed just before, without the schema:
    a loaded 2-core machine pauses on its own.)"""
    # (the checker's process and the rank's grammar backend are made on first use, which costs
    # seconds of CPU that would be measured here too: done first, with a quick schema)
    quick = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
    r = _post(server, {"prompt": "x", "max_tokens": 2, "response_format": quick})
    assert r.status_code == 200, r.text
    stream = _Stream(server)
    stream.start()
    deadline = time.monotonic() + 60
    while len(stream.times) < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(stream.times) >= 20, "the stream did not start"
    quiet_end = time.monotonic() + 3
    quiet_health = _health_times(server, lambda: time.monotonic() > quiet_end)
    quiet = _gaps(list(stream.times))
    began = time.monotonic()
    result: dict = {}

    def structured():
        fmt = {"type": "json_schema", "json_schema": {"name": "ab", "schema": SLOW_SCHEMA}}
        body = {"prompt": "x", "max_tokens": 3, "response_format": fmt}
        # (its compile yields the CPU to the steps: on a loaded machine it takes a while)
        result["r"] = httpx.post(server.url + "/v1/completions", json=body, timeout=600)

    asker = threading.Thread(target=structured, daemon=True)
    asker.start()
    health = _health_times(server, lambda: not asker.is_alive())
    ended = time.monotonic()
    stream.stop.set()
    stream.join(30)  # (at its next chunk: its request is aborted when it hangs up)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith('"'), r.text  # (the grammar was applied)
    gaps = _gaps([began, *(t for t in stream.times if began <= t <= ended), ended])
    usual = statistics.median(quiet)
    print(
        f"schema request {ended - began:.2f} s; stream gaps: median {usual * 1e3:.0f} ms, "
        f"longest {max(quiet) * 1e3:.0f} ms before, {max(gaps) * 1e3:.0f} ms while the schema "
        f"was checked; /health at most {max(quiet_health) * 1e3:.0f} ms before, "
        f"{max(health) * 1e3:.0f} ms while ({len(health)} calls)"
    )
    assert max(health) < max(1.0, 3 * max(quiet_health)), health
    # (about a step, generously: the pause of converting and compiling the schema in the way
    # was seconds)
    assert max(gaps) < max(2.0, 3 * max(quiet), 20 * usual), (max(gaps), max(quiet), usual)
    _served(server)


def test_a_whole_vocabulary_logit_bias_is_400(server):
    whole = {str(t): -1.0 for t in range(128)}
    r = _post(server, {"prompt": [1, 2], "max_tokens": 2, "logit_bias": whole})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and "--max-logit-bias" in err["message"], err
    within = {str(t): 5.0 for t in range(MAX_BIAS)}
    r = _post(server, {"prompt": [1, 2], "max_tokens": 2, "logit_bias": within})
    assert r.status_code == 200, r.text
    for key in ("²", "9" * 5000):  # (int() takes the first and refuses the second: a 500)
        r = _post(server, {"prompt": [1], "max_tokens": 1, "logit_bias": {key: 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_logit_bias_past_openais_300_entries_is_refused_by_default():
    """(No server: the check `sampling` makes, with the default limits.)"""
    for entries in (301, 151_936):  # (past the cap; a whole Qwen vocabulary)
        body = CompletionRequest(prompt=[1], logit_bias={str(t): 1.0 for t in range(entries)})
        with pytest.raises(BadRequest, match="--max-logit-bias") as e:
            sampling(body, Limits(), 16)
        assert e.value.param == "logit_bias"
    body = CompletionRequest(prompt=[1], logit_bias={str(t): 1.0 for t in range(300)})
    assert len(sampling(body, Limits(), 16).params[0].logit_bias) == 300


def test_deep_tool_call_arguments_are_400(server):
    deep = "[" * 100_000 + "]" * 100_000
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": deep}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ]
    r = _post(server, {"messages": messages, "max_tokens": 2}, "/v1/chat/completions")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "deeper" in err["message"], err
    deep_schema = {"type": "object"}
    for _ in range(200):
        deep_schema = {"type": "object", "properties": {"a": deep_schema}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep_schema}}]
    r = _post(
        server,
        {"messages": messages[:1], "tools": tools, "max_tokens": 2},
        "/v1/chat/completions",
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    _served(server)


def test_no_path_in_models(server, ckpt):
    r = httpx.get(server.url + "/v1/models", timeout=10)
    assert r.status_code == 200
    (model,) = r.json()["data"]
    assert model["root"] == model["id"] == ckpt.name, model
    assert str(ckpt) not in r.text and str(ckpt.parent) not in r.text, r.text
    # (clients that name the model as --model was given are still served)
    r = _post(server, {"model": str(ckpt), "prompt": [3], "max_tokens": 1})
    assert r.status_code == 200 and str(ckpt) not in r.text, r.text


def test_a_full_queue_is_503_with_retry_after(server):
    n = MAX_SEQS + MAX_QUEUED + 1  # (one request's sequences: more than run and may wait)
    r = _post(server, {"prompt": [3], "max_tokens": 1, "n": n})
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and "--max-queued-requests" in err["message"]
    _served(server)


def test_the_queue_is_finite_by_default():
    args = build_parser().parse_args(["--model", "x"])
    assert isinstance(args.max_queued_requests, int) and args.max_queued_requests > 0


def _stalled(server, head: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(head)
    s.settimeout(READ_TIMEOUT_S + 8)
    return s


def _answer(s: socket.socket) -> tuple[bytes, float]:
    """What the server sends until it closes, and when it closed (after the call)."""
    t = time.monotonic()
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except TimeoutError:
        return data, float("inf")
    finally:
        s.close()
    return data, time.monotonic() - t


def test_a_stalled_body_is_cut_off_and_others_are_served(server):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n"
    )
    t = time.monotonic()
    slow = [_stalled(server, head + b'{"pro') for _ in range(3)]
    _served(server)  # (meanwhile everyone else is served at once)
    assert time.monotonic() - t < READ_TIMEOUT_S, "others waited on the stalled bodies"
    for s in slow:
        data, waited = _answer(s)
        assert waited < READ_TIMEOUT_S + 5, data
        assert data.startswith(b"HTTP/1.1 408"), data
        assert b"--request-read-timeout" in data, data
    _served(server)


def test_stalled_headers_are_cut_off(server):
    s = _stalled(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    t = time.monotonic()
    closed = threading.Event()

    def drip():  # (a header byte now and then: each used to restart nothing)
        while not closed.is_set():
            try:
                s.sendall(b"X")
            except OSError:
                return
            time.sleep(0.3)

    threading.Thread(target=drip, daemon=True).start()
    data, waited = _answer(s)
    closed.set()
    assert waited < READ_TIMEOUT_S + 5 and time.monotonic() - t >= READ_TIMEOUT_S - 0.5, data
    idle = _stalled(server, b"")  # (a connection that sends nothing at all)
    _, waited = _answer(idle)
    assert waited < READ_TIMEOUT_S + 5
    _served(server)
