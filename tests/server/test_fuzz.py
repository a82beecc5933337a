"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis reads
FastAPI's ``/openapi.json``): valid and invalid bodies for every operation, a bounded number of
cases. Every answer is a 2xx, or a 4xx in OpenAI's error shape that names the problem; no 5xx;
no answer carries a traceback or a path. Afterwards the server still serves: ``/health`` is ok
and a greedy request gives HF's tokens (what `LLM.generate` gives, tests/test_e2e_hf.py)."""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode
from server_proc import Server
from tiny_models import prompt_ids

MODEL = "tiny"
KEY = "fuzz-key"
CASES = int(os.environ.get("SPLITMOE_FUZZ_CASES", "150"))  # per POST operation and mode


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("qwen3_moe")


@pytest.fixture(scope="module")
def server(ckpt):
    # small limits keep each generated request cheap: what a fuzzer reaches is the same code
    srv = Server(
        ckpt,
        *("--served-model-name", MODEL, "--max-model-len", "24", "--max-num-seqs", "16"),
        *("--max-prompts-per-request", "2", "--max-n", "2", "--max-request-bytes", "65536"),
        api_key=KEY,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


SEEN: dict[str, int] = {}


def _check(response, label: str) -> None:
    status = response.status_code
    SEEN[f"{label} {status}"] = SEEN.get(f"{label} {status}", 0) + 1
    text = response.text
    for leak in ("Traceback", 'File "', '.py"', "site-packages"):
        assert leak not in text, (label, status, text[:500])
    assert status < 500, (label, status, text[:500])
    if status >= 400:
        err = response.json()["error"]
        if os.environ.get("SPLITMOE_FUZZ_VERBOSE"):
            print(label, status, err["message"][:120])
        assert err["code"] == status and err["type"] and err["message"], text[:500]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzz_post(schema, server, path, mode):
    strategy = schema[path]["POST"].as_strategy(generation_mode=mode)

    @settings(
        max_examples=CASES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    @given(case=strategy, key_draw=st.integers(0, 9))
    def run(case, key_draw):
        keyed = key_draw < 9  # (hypothesis favours 0: mostly with the key)
        headers = {"Authorization": f"Bearer {KEY}"} if keyed else {}
        response = case.call(base_url=server.url, headers=headers, timeout=60)
        _check(response, f"POST {path} {mode.value}")
        if not keyed:
            assert response.status_code == 401, response.text[:300]

    run()


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/metrics"])
def test_fuzz_get(schema, server, path):
    strategy = schema[path]["GET"].as_strategy()

    @settings(max_examples=10, deadline=None, database=None, derandomize=True)
    @given(case=strategy)
    def run(case):
        response = case.call(
            base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        )
        _check(response, f"GET {path}")
        assert response.status_code == 200, response.text[:300]

    run()


def test_after_the_fuzz_it_still_serves(server, ckpt, hf_ref):
    print("fuzzed cases:", SEEN, "total", sum(SEEN.values()))
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    prompt = prompt_ids(6, seed=11)
    r = httpx.post(
        server.url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == hf_ref(ckpt, prompt, 8)
