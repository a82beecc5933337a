"""The server under torchrun: rank 0 serves (its attention rank a child process), rank 1 is an
expert rank; HF's tokens come back; SIGTERM to rank 0 drains and ends the whole job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
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


def test_torchrun_rank0_serves(tiny_ckpt, hf_ref, tmp_path):
    ckpt = tiny_ckpt("qwen3_moe")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "splitmoe.serve",
        "--model",
        str(ckpt),
        "--attention-ranks",
        "1",
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
        prompt = prompt_ids(9, seed=31)
        r = httpx.post(
            url + "/v1/completions",
            timeout=60,
            json={
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        assert r.json()["choices"][0]["token_ids"] == hf_ref(ckpt, prompt, 8)
        workers = [p for agent in children(job.pid) for p in [agent, *children(agent)]]
        rank0 = [
            p
            for p in workers
            if _rank_of(p) == 0 and b"splitmoe.serve" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        assert rank0
        os.kill(rank0[0], signal.SIGTERM)
        assert job.wait(60) == 0
        assert not [
            p
            for p in workers
            if Path(f"/proc/{p}").exists()
            and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1][:3]
        ]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        log.close()
