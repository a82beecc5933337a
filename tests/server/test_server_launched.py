"""The server under torchrun: rank 0 serves (its attention rank 0 a child process), rank 1 is an
attention rank in another process (connected to rank 0's server directly), rank 2 an
expert rank; HF's tokens come back from both attention ranks, whole and streamed; /metrics
shows both ranks' prefix caches and the expert rank's load; SIGTERM to rank 0 drains and ends
the whole job."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server_proc import REPO, children, free_port
from tiny_models import prompt_ids


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _gauges(text: str, name: str, label: str = "rank") -> dict[str, float]:
    return {
        s.labels.get(label, ""): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    }


def test_torchrun_rank0_serves_two_attention_ranks(tiny_ckpt, hf_ref, tmp_path):
    ckpt = tiny_ckpt("qwen3_moe")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "3",
        "--master-port",
        str(free_port()),
        "-m",
        "splitmoe.serve",
        "--model",
        str(ckpt),
        "--attention-ranks",
        "2",
        "--block-size",
        "4",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--served-model-name",
        "tiny",
    ]
    log = open(tmp_path / "torchrun.log", "w+")
    job = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert job.poll() is None, log.seek(0) or log.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the launched server never became healthy"
            time.sleep(0.3)
        # one call, four prompts: the router spreads them over both attention ranks
        prompts = [prompt_ids(9 + i, seed=31 + i) for i in range(4)]
        body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(
            url + "/v1/completions",
            timeout=60,
            json={**body, "prompt": prompts, "return_token_ids": True},
        )
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["token_ids"] for c in choices] == [hf_ref(ckpt, p, 8) for p in prompts]
        # (each rank's counters are published about a second after they change, rank 1's
        # published by each rank on its own: poll until both show the prompts' blocks)
        deadline = time.monotonic() + 15
        while True:
            text = httpx.get(url + "/metrics", timeout=30).text
            cached = _gauges(text, "splitmoe:prefix_cache_blocks")
            if set(cached) == {"0", "1"} and all(v > 0 for v in cached.values()):
                break
            assert time.monotonic() < deadline, cached
            time.sleep(0.3)
        assert _gauges(text, "splitmoe:expert_rank_tokens")["2"] > 0
        # streamed, both ranks busy at once: rank 1's tokens come as they are made
        with httpx.Client(timeout=60) as client:
            with client.stream(
                "POST",
                url + "/v1/completions",
                json={**body, "prompt": prompts[:2], "stream": True, "return_token_ids": True},
            ) as resp:
                got: dict[int, list[int]] = {0: [], 1: []}
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        for c in json.loads(line[6:])["choices"]:
                            got[c["index"]] += c.get("token_ids") or []
        assert [got[0], got[1]] == [c["token_ids"] for c in choices[:2]]
        # two long streams at once (one per attention rank) whose clients leave: both ranks
        # abort theirs and free its KV blocks
        with httpx.Client(timeout=60) as client, contextlib.ExitStack() as streams:
            for p in prompts[2:]:
                resp = streams.enter_context(
                    client.stream(
                        "POST",
                        url + "/v1/completions",
                        json={**body, "prompt": p, "max_tokens": 200, "stream": True},
                    )
                )
                next(resp.iter_lines())
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(url + "/metrics", timeout=30).text
            aborted = _gauges(text, "splitmoe:request_success_total", "finished_reason")
            usage = _gauges(text, "splitmoe:kv_cache_usage_perc")[""]
            if usage == 0 and aborted.get("abort") == 2:
                break
            assert time.monotonic() < deadline, (aborted, usage)
            time.sleep(0.3)
        workers = [p for agent in children(job.pid) for p in [agent, *children(agent)]]
        rank0 = [
            p
            for p in workers
            if _rank_of(p) == 0 and b"splitmoe.serve" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        assert rank0
        os.kill(rank0[0], signal.SIGTERM)
        assert job.wait(60) == 0
        deadline = time.monotonic() + 10  # (a fork server exits as its interpreter ends: ~1 s)
        while left := [p for p in workers if _running(p)]:
            assert time.monotonic() < deadline, left
            time.sleep(0.1)
    finally:
        if job.poll() is None:  # (failed: stop the ranks too, not only the launcher)
            tree, todo = [], [job.pid]
            while todo:
                tree.append(todo.pop())
                todo += children(tree[-1])
            for pid in reversed(tree):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            job.wait()
        log.close()


def _running(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]
    except OSError:
        return False


def test_launched_attention_ranks_beyond_the_world(tiny_ckpt, monkeypatch, capsys):
    """Checked on every rank before the rendezvous: a clear error, exit code 2."""
    from splitmoe.serve import main

    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    ckpt = str(tiny_ckpt("qwen3_moe"))
    assert main(["--model", ckpt, "--attention-ranks", "3", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--attention-ranks 3 exceeds the torchrun world size 2" in err
