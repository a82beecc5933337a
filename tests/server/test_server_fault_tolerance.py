"""`python -m splitmoe.serve --fault-tolerance`: an expert rank, or the attention rank serving
the stream, SIGKILLed while a client streams; the stream goes on to its last token, with the
tokens of HF transformers' greedy run (those of a run without the failure), none repeated or
missing; /health answers 200 throughout and /metrics counts the recovery.

1 attention + 2 expert ranks with 8 replica slots (every expert on both expert ranks: losing
either is covered by replicas), or 2 attention + 1 expert ranks, tiny Qwen3-MoE, float32.
"""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest
from server_proc import Server, rank_processes
from tiny_models import prompt_ids

MAX_TOKENS = 40


def _spawned_in_start_order(pid: int) -> list[int]:
    """The server's rank processes, oldest first: the front end starts them in rank order."""
    return rank_processes(pid)


@pytest.mark.parametrize(
    "attention,experts,redundant,victim",
    [
        (1, 2, 8, 2),  # the last expert rank
        (2, 1, 0, 0),  # the attention rank serving the stream: it resumes on the other one
    ],
)
def test_stream_survives_a_rank_kill(tiny_ckpt, hf_ref, attention, experts, redundant, victim):
    ckpt = tiny_ckpt("qwen3_moe")
    srv = Server(
        ckpt,
        "--attention-ranks", str(attention), "--expert-ranks", str(experts),
        "--redundant-experts", str(redundant), "--fault-tolerance", "--timeout", "20",
    )  # fmt: skip
    try:
        ranks = _spawned_in_start_order(srv.proc.pid)
        assert len(ranks) == 3, ranks
        killed = False
        prompt = prompt_ids(7, seed=4242)
        body = {
            "model": str(ckpt), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True,
        }  # fmt: skip
        tokens: list[int] = []
        health = []
        with httpx.Client(timeout=60) as http:
            model = http.get(srv.url + "/v1/models").json()["data"][0]["id"]
            body["model"] = model
            with http.stream("POST", srv.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    tokens += chunk["choices"][0].get("token_ids") or []
                    if len(tokens) >= 4 and not killed:
                        os.kill(ranks[victim], signal.SIGKILL)
                        killed = True
                        health.append(http.get(srv.url + "/health"))
            health.append(http.get(srv.url + "/health"))
        assert tokens == hf_ref(ckpt, prompt, MAX_TOKENS)
        assert all(h.status_code == 200 for h in health)
        assert health[-1].json()["status"] == "ok"
        m = srv.metrics()
        assert m["splitmoe:recoveries_total"] == 1
        assert m["splitmoe:recovery_time_seconds_count"] == 1
    finally:
        srv.stop()
