"""The OpenAI-compatible server, colocated (1 attention rank), through the real `openai` client.

One server process serves the whole module (tiny Qwen3-MoE checkpoint, an API key); HF
transformers' greedy tokens are the oracle for what it generates. The last test kills a rank.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import httpx
import openai
import pytest
from server_proc import Server, rank_processes
from tiny_models import prompt_ids

KEY = "test-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    # (the same weights with a longer context: a long shared prefix makes prefill dominate TTFT)
    return tiny_ckpt("qwen3_moe", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(ckpt):
    # (the default warm-up, logged with -v: every test here runs after it)
    srv = Server(
        ckpt, "--served-model-name", MODEL, "--max-num-seqs", "64", "-v", api_key=KEY, warmup=True
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _greedy(**extra) -> dict:
    return {"temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True, **extra}}


def test_the_server_warms_up_before_it_answers_health(server):
    # (made-up requests at batch sizes 1..64 and prompt chunks from 32 tokens, then ready)
    assert "warmed up in" in server.output()
    assert "'decode_batches': [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]" in server.output()


def test_completions_match_hf_streamed_or_not(client, ckpt, hf_ref):
    prompts = [prompt_ids(n, seed=i) for i, n in enumerate((1, 7, 20))]
    res = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, **_greedy())
    assert [c.index for c in res.choices] == [0, 1, 2]
    for p, choice in zip(prompts, res.choices):
        assert choice.token_ids == hf_ref(ckpt, p, 12)
        assert choice.finish_reason == "length"
    u = res.usage
    assert (u.prompt_tokens, u.completion_tokens) == (28, 36)
    assert u.total_tokens == 64
    assert u.prompt_tokens_details.cached_tokens == 0

    # streamed: the deltas of each choice add up to the non-streamed text and tokens
    stream = client.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **_greedy(),
    )
    texts, tokens, usage, reasons = ["", "", ""], [[], [], []], None, {}
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            tokens[c.index] += c.token_ids
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == [c.text for c in res.choices]
    assert tokens == [c.token_ids for c in res.choices]
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (28, 36)


def test_text_prompt_and_chat_match_hf(client, ckpt, hf_ref):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    text = "Hello there"
    res = client.completions.create(model=MODEL, prompt=text, max_tokens=10, **_greedy())
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert res.choices[0].token_ids == hf_ref(ckpt, ids, 10)
    assert res.choices[0].text == tok.decode(hf_ref(ckpt, ids, 10), skip_special_tokens=True)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "input_ids"):
        chat_ids = chat_ids["input_ids"]
    want = tok.decode(hf_ref(ckpt, chat_ids, 10), skip_special_tokens=True)
    res = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == want
    assert res.usage.prompt_tokens == len(chat_ids)
    assert res.usage.completion_tokens == 10

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got, roles, last = "", set(), None
    for chunk in stream:
        for c in chunk.choices:
            roles.add(c.delta.role)
            got += c.delta.content or ""
            last = c.finish_reason or last
    assert got == want
    assert "assistant" in roles and last == "length"


def test_n_with_seed_is_reproducible(client):
    kw = dict(model=MODEL, prompt=prompt_ids(5, seed=3), max_tokens=16, n=2, temperature=1.0)
    a = client.completions.create(seed=7, **kw, extra_body={"return_token_ids": True})
    b = client.completions.create(seed=7, **kw, extra_body={"return_token_ids": True})
    assert len(a.choices) == 2
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]
    assert a.choices[0].token_ids != a.choices[1].token_ids  # (each copy its own stream)
    assert a.usage.prompt_tokens == 5 and a.usage.completion_tokens <= 32


def test_stop_strings_cut_the_text(client):
    prompt = prompt_ids(6, seed=4)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **_greedy())
    text = full.choices[0].text
    stop = text[8:10]
    assert len(stop) == 2 and text.find(stop) >= 1, text
    cut = text[: text.find(stop)]
    for stream in (False, True):
        res = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=24,
            stop=[stop, "\x00never"],
            stream=stream,
            **_greedy(),
        )
        if stream:
            chunks = list(res)
            got = "".join(c.text for ch in chunks for c in ch.choices)
            reason = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
            assert got == cut and reason == ["stop"]
        else:
            assert res.choices[0].text == cut
            assert res.choices[0].finish_reason == "stop"
            assert (
                res.choices[0].token_ids
                == full.choices[0].token_ids[: len(res.choices[0].token_ids)]
            )
            assert len(res.choices[0].token_ids) <= len(cut) + len(stop)
            assert res.usage.completion_tokens == len(res.choices[0].token_ids)


def test_stop_token_ids_and_logprobs(client, ckpt, hf_ref):
    prompt = prompt_ids(9, seed=5)
    want = hf_ref(ckpt, prompt, 12)
    res = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        logprobs=3,
        **_greedy(stop_token_ids=[want[4]]),
    )
    ch = res.choices[0]
    stop_at = want.index(want[4])
    assert ch.token_ids == want[: stop_at + 1] and ch.finish_reason == "stop"
    lp = ch.logprobs
    assert len(lp.token_logprobs) == len(ch.token_ids)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the top token


async def _stream_one(client, i: int, max_tokens: int) -> tuple[int, int, int]:
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt_ids(3 + i % 11, seed=100 + i),
        max_tokens=max_tokens,
        stream=True,
        temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    tokens, finishes, usage = 0, 0, None
    async for chunk in stream:
        for c in chunk.choices:
            tokens += len(c.token_ids)
            finishes += c.finish_reason is not None
        usage = chunk.usage or usage
    return tokens, finishes, usage.completion_tokens


def test_64_concurrent_streams(server):
    async def run():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1",
            api_key=KEY,
            max_retries=0,
            http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=100)),
        ) as client:
            return await asyncio.gather(*(_stream_one(client, i, 5 + i % 7) for i in range(64)))

    results = asyncio.run(run())
    for i, (tokens, finishes, completion) in enumerate(results):
        assert (tokens, finishes, completion) == (5 + i % 7, 1, 5 + i % 7), i


def _wait_kv_idle(server, timeout=20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["splitmoe:kv_cache_usage_perc"] == 0 and m["splitmoe:num_requests_running"] == 0:
            return m
        assert time.monotonic() < deadline, f"KV cache never returned to idle: {m}"
        time.sleep(0.1)


def test_disconnect_frees_blocks(server):
    before = server.metrics().get("splitmoe:request_success_total", 0)
    body = {
        "model": MODEL,
        "prompt": prompt_ids(40, seed=9),
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST", server.url + "/v1/completions", json=body, headers=server.headers
        ) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # some tokens, then hang up
            assert any(line.startswith("data: {") for line in got)
            # mid-flight the request holds KV blocks
            assert server.metrics()["splitmoe:kv_cache_usage_perc"] > 0
    t0 = time.monotonic()
    m = _wait_kv_idle(server)
    assert time.monotonic() - t0 < 5
    assert m["splitmoe:request_success_total"] == before + 1  # (counted as "abort")
    # the server goes on serving
    res = httpx.post(
        server.url + "/v1/completions",
        headers=server.headers,
        json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2},
        timeout=30,
    )
    assert res.status_code == 200


def _aborted(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "splitmoe:request_success_total" and s.labels.get("finished_reason") == "abort"
    )


def test_a_non_streamed_client_that_leaves_aborts_its_busy_request(server):
    """Its request makes progress every step: the server still notices the client left."""
    before = _aborted(server)
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": prompt_ids(40, seed=3),
            "max_tokens": 1000,
            "n": 4,
            "temperature": 0,
            "ignore_eos": True,
        }
    ).encode()
    auth = "".join(f"{k}: {v}\r\n" for k, v in server.headers.items())
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    deadline = time.monotonic() + 30
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head.encode() + body)
        while server.metrics().get("splitmoe:num_requests_running", 0) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    while _aborted(server) < before + 4:  # (each of its n sequences)
        assert time.monotonic() < deadline, "the request ran on after its client left"
        time.sleep(0.1)
    _wait_kv_idle(server)


BAD = [
    ("not json", "{bad", 400, "not valid JSON"),
    ("array body", "[1, 2]", 400, "JSON object"),
    (
        "wrong type",
        {"prompt": [3, 4], "max_tokens": "many"},
        400,
        "'max_tokens' must be an integer",
    ),
    ("max_tokens 0", {"prompt": [3, 4], "max_tokens": 0}, 400, "'max_tokens' must be >= 1"),
    ("temperature", {"prompt": [3], "temperature": -1}, 400, "'temperature' must be >= 0"),
    ("empty prompt", {"prompt": ""}, 400, "'prompt' must be a non-empty string"),
    ("empty ids", {"prompt": [[]]}, 400, "'prompt' must be a non-empty string"),
    ("no prompt", {"max_tokens": 3}, 400, "'prompt' is required"),
    ("too long", {"prompt": [5] * 2100}, 400, "max_model_len"),
    ("out of vocab", {"prompt": [5, 100000]}, 400, "outside the vocabulary"),
    ("stop type", {"prompt": [5], "stop": 3}, 400, "'stop' must be"),
    ("unknown model", {"prompt": [5], "model": "gpt-9"}, 404, "'gpt-9' does not exist"),
]


@pytest.mark.parametrize("name,body,status,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_then_good(server, name, body, status, needle):
    if isinstance(body, dict):
        body = json.dumps({"model": MODEL, **body})
    r = httpx.post(server.url + "/v1/completions", content=body, headers=server.headers, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status and err["type"]
    ok = httpx.post(
        server.url + "/v1/completions",
        headers=server.headers,
        timeout=30,
        json={"model": MODEL, "prompt": [7, 8], "max_tokens": 2},
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_auth_models_health_chat_errors(server, client):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/completions", headers=headers, json={"prompt": [3]})
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    with pytest.raises(openai.BadRequestError, match="'messages' must have at least 1"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}])


def test_prefix_cache_hits_are_faster_and_exact(server, client, ckpt, hf_ref):
    """A second request sharing a long prefix reports cached tokens, a lower TTFT and the same
    tokens as HF (no cache there)."""

    def ttft(prompt) -> tuple[float, list[int], int]:
        t0 = time.perf_counter()
        stream = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            **_greedy(),
        )
        first, tokens, cached = None, [], None
        for chunk in stream:
            for c in chunk.choices:
                if c.token_ids and first is None:
                    first = time.perf_counter() - t0
                tokens += c.token_ids
            if chunk.usage:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
        return first, tokens, cached

    cold, warm = [], []
    for i in range(3):
        prefix = prompt_ids(1600, seed=200 + i)
        t_cold, tok_cold, c_cold = ttft(prefix + [10, 11])
        t_warm, tok_warm, c_warm = ttft(prefix + [12, 13, 14])
        assert c_cold == 0 and c_warm == 1600  # (100 full blocks of 16 shared)
        assert tok_cold == hf_ref(ckpt, prefix + [10, 11], 4)
        assert tok_warm == hf_ref(ckpt, prefix + [12, 13, 14], 4)
        cold.append(t_cold)
        warm.append(t_warm)
    assert min(warm) < min(cold), (cold, warm)  # (min: robust to a busy host)
    m = server.metrics()
    assert m["splitmoe:prefix_cache_hits_total"] >= 3 * 1600
    assert 0 < m["splitmoe:prefix_cache_hit_rate"] < 1


METRICS = [
    "splitmoe:request_success_total",
    "splitmoe:num_requests_running",
    "splitmoe:num_requests_waiting",
    "splitmoe:prompt_tokens_total",
    "splitmoe:generation_tokens_total",
    "splitmoe:time_to_first_token_seconds_count",
    "splitmoe:inter_token_latency_seconds_count",
    "splitmoe:e2e_request_latency_seconds_count",
    "splitmoe:kv_cache_usage_perc",
    "splitmoe:prefix_cache_hit_rate",
    "splitmoe:expert_rank_imbalance",
]


def test_metrics_parse(server):
    m = server.metrics()  # (prometheus_client's parser)
    missing = [name for name in METRICS if name not in m]
    assert not missing
    assert m["splitmoe:prompt_tokens_total"] > 0 and m["splitmoe:generation_tokens_total"] > 0
    assert m["splitmoe:time_to_first_token_seconds_count"] > 0


def test_rank_failure_fails_requests_not_hangs(server):
    """Killing the attention rank mid-request: running requests (streamed or not) get an
    error, /health says 503, new requests get 503 (this server is done after it)."""
    ranks = rank_processes(server.proc.pid)
    assert ranks
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 240, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(timeout=60, headers=server.headers) as http:
            plain = asyncio.create_task(http.post(server.url + "/v1/completions", json=body))
            events = []
            async with http.stream(
                "POST", server.url + "/v1/completions", json={**body, "stream": True}
            ) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and not events:
                        for pid in ranks:
                            os.kill(pid, signal.SIGKILL)
                    if line.startswith("data: "):
                        events.append(line[6:])
            return await plain, events

    r, events = asyncio.run(run())
    assert r.status_code == 503 and "rank 0" in r.json()["error"]["message"], r.text
    last = json.loads(events[-1])
    assert last["error"]["code"] == 503 and "rank 0" in last["error"]["message"]
    h = httpx.get(server.url + "/health")
    assert h.status_code == 503 and h.json()["status"] == "failed"
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers)
    assert r.status_code == 503
