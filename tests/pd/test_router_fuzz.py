"""Property-based fuzzing of the prefill-decode router from its own OpenAPI schema (the same
request models as the server's, tests/server/test_fuzz.py): valid and invalid bodies for both
POST operations, a bounded number of cases, through a prefill (1+0) and a decode instance
(1+0). Every answer is a 2xx, or a 4xx in OpenAI's error shape; no 5xx, no traceback, no path;
afterwards the router still serves HF's greedy tokens and no instance holds a KV block."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode

pytest.importorskip("mooncake.engine")

from pd.pd_setup import MOONCAKE, Router, wait_all_free  # noqa: E402
from server.server_proc import Server  # noqa: E402
from tiny_models import prompt_ids  # noqa: E402

MODEL = "tiny"
KEY = "fuzz-key"
CASES = int(os.environ.get("SPLITMOE_ROUTER_FUZZ_CASES", "40"))  # per operation and mode
SMALL = (
    *("--served-model-name", MODEL, "--max-model-len", "24", "--max-num-seqs", "16"),
    *("--max-prompts-per-request", "2", "--max-n", "2", "--attention-ranks", "1"),
)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("qwen3_moe")


@pytest.fixture(scope="module")
def router(ckpt):
    roles = [("--kv-role", "prefill", *MOONCAKE), ("--kv-role", "decode", *MOONCAKE)]
    with ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(Server, ckpt, *SMALL, *r, api_key=KEY) for r in roles]
    servers = [f.result() for f in starts if f.exception() is None]
    rt = None
    try:
        if len(servers) < 2:
            raise next(f.exception() for f in starts if f.exception() is not None)
        rt = Router([servers[0].url], [servers[1].url], "--max-request-bytes", "65536")
        yield rt, servers
    finally:
        if rt is not None:
            rt.stop()
        for s in servers:
            s.stop()


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
        assert err["code"] == status and err["type"] and err["message"], text[:500]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzz_router(router, path, mode):
    rt, _ = router
    schema = schemathesis.openapi.from_url(rt.url + "/openapi.json")
    strategy = schema[path]["POST"].as_strategy(generation_mode=mode)

    @settings(
        max_examples=CASES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    @given(case=strategy)
    def run(case):
        headers = {"Authorization": f"Bearer {KEY}"}
        response = case.call(base_url=rt.url, headers=headers, timeout=60)
        _check(response, f"POST {path} {mode.value}")

    run()


def test_after_the_fuzz_the_router_still_serves(router, ckpt, hf_ref):
    rt, servers = router
    print("fuzzed cases:", SEEN, "total", sum(SEEN.values()))
    assert httpx.get(rt.url + "/health", timeout=10).json()["status"] == "ok"
    prompt = prompt_ids(6, seed=11)
    r = httpx.post(
        rt.url + "/v1/completions",
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
    wait_all_free(*servers, timeout=60)
