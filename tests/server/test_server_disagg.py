"""The server over a disaggregated job (1 attention + 1 expert rank): the same tokens as HF,
a full queue answered with 503, and SIGTERM draining a load run with no rank left behind."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from server_proc import Server, descendants
from tiny_models import prompt_ids

MODEL = "tiny"


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("qwen3_moe")


@pytest.fixture(scope="module")
def server(ckpt):
    srv = Server(
        ckpt,
        *("--served-model-name", MODEL, "--attention-ranks", "1", "--expert-ranks", "1"),
        *("--max-num-seqs", "2", "--max-queued-requests", "1", "--no-prefix-caching"),
    )
    yield srv
    srv.stop()


def test_disaggregated_matches_hf(server, ckpt, hf_ref):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    prompts = [prompt_ids(n, seed=20 + n) for n in (3, 17)]
    res = client.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert [c.token_ids for c in res.choices] == [hf_ref(ckpt, p, 10) for p in prompts]
    stream = client.completions.create(
        model=MODEL,
        prompt=prompts[1],
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.text for ch in stream for c in ch.choices) == res.choices[1].text
    assert res.usage.prompt_tokens_details.cached_tokens == 0  # (--no-prefix-caching)


def test_full_queue_is_503(server):
    """2 run (max_num_seqs), 1 may wait (--max-queued-requests): of 4 at once, one gets 503."""
    body = {"model": MODEL, "prompt": [4, 5], "max_tokens": 200, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(
                *(http.post(server.url + "/v1/completions", json=body) for _ in range(4))
            )

    responses = asyncio.run(run())
    assert sorted(r.status_code for r in responses) == [200, 200, 200, 503]
    [full] = [r for r in responses if r.status_code == 503]
    assert "queue is full" in full.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_sigterm_drains(server):
    """SIGTERM during a load run: every in-flight request finishes (or gets an error), the
    server exits, and no rank process remains."""
    ranks = descendants(server.proc.pid)
    assert len(ranks) >= 2
    body = {"model": MODEL, "max_tokens": 30, "ignore_eos": True, "stream": True}

    async def one(http, i):
        text, events = "", []
        try:
            async with http.stream(
                "POST", server.url + "/v1/completions", json={**body, "prompt": [5 + i, 6]}
            ) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
        except httpx.HTTPError as e:
            return "error", repr(e)
        return ("done" if events and events[-1] == "[DONE]" else "error"), text

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            tasks = [asyncio.create_task(one(http, i)) for i in range(3)]
            await asyncio.sleep(0.3)
            server.proc.terminate()  # SIGTERM
            return await asyncio.gather(*tasks)

    t0 = time.monotonic()
    results = asyncio.run(run())
    assert server.proc.wait(60) == 0
    assert time.monotonic() - t0 < 60
    assert all(kind in ("done", "error") for kind, _ in results)
    assert sum(kind == "done" for kind, _ in results) >= 1, results  # (they ran to the end)
    deadline = time.monotonic() + 10  # (the fork server exits as its interpreter ends: ~1 s)
    while alive := [pid for pid in ranks if _alive(pid)]:
        assert time.monotonic() < deadline, f"processes {alive} outlived the server"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
