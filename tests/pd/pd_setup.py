"""What the prefill-decode tests share: the router as a subprocess, the instances' KV state,
one completion through the `openai` client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
from server.server_proc import REPO, Server, free_port

from splitmoe.kv_transfer.auth import HEADER, SECRET_ENV, sign

MOONCAKE = ("--kv-connector", "mooncake")
NAME = ("--served-model-name", "m")
MAX_TOKENS = 8


class Router:
    """`splitmoe.router` as a subprocess on a free local port."""

    def __init__(
        self, prefill: list[str], decode: list[str], *args: str, start_timeout: float = 60
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "splitmoe.router", "--port", str(self.port), "--timeout", "60"]
        cmd += ["--prefill", *prefill, "--decode", *decode, *args]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(cmd, env=env)
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                httpx.get(self.url + "/health", timeout=5)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("the router did not start") from None
                time.sleep(0.2)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=90)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def signed(payload: bytes) -> dict:
    """The header that makes a request the router's (`splitmoe.kv_transfer.auth`)."""
    return {HEADER: sign(os.environ[SECRET_ENV].encode(), payload)}


def kv_state(server: Server) -> dict:
    r = httpx.get(server.url + "/internal/kv", headers=signed(b"/internal/kv"), timeout=10)
    r.raise_for_status()
    return r.json()


def wait_all_free(*servers: Server, timeout: float = 15) -> list[dict]:
    """Every attention rank of ``servers`` holds no KV block and parks none (their published
    counters lag by about a second); returns the last states seen."""
    deadline = time.monotonic() + timeout
    while True:
        states = [kv_state(s) for s in servers]
        ranks = [r for st in states for r in st["ranks"]]
        busy = [
            r
            for r in ranks
            if r.get("kv_blocks_used") or r.get("kv_parked") or r.get("kv_window_blocks_used")
        ]
        if ranks and not busy:
            return states
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks still held after {timeout} s: {states}")
        time.sleep(0.3)


def completion(client: openai.OpenAI, prompt: list[int], max_tokens: int = MAX_TOKENS, **kw):
    return client.completions.create(
        model="m",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True},
        **kw,
    )


def near_tie(ref, got, tol: float = 1e-4) -> bool:
    """Whether the first token where ``got`` leaves ``ref`` was (nearly) tied with ``ref``'s
    token there: float32 sums in another order may pick either. Measured in-process on the
    three families (32 prompts, 8 tokens, logprobs of the top 2): PD is at most 2.9e-6 from one
    instance, no more than one instance is from itself with the prompts sent one by one
    instead of together (2.9e-6 to 3.1e-6); at the first token 1.2e-6 to 1.9e-6 where 1+1 and
    1+0 agree exactly, as the decode side computes the last prompt token in a decode step, not
    inside the prompt's prefill. Wrong KV moves logits by far more than ``tol``."""
    a, b = ref.choices[0].logprobs, got.choices[0].logprobs
    for k, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        if x != y:
            top = a.top_logprobs[k]
            return y in top and abs(top[y] - a.token_logprobs[k]) < tol
    return False
