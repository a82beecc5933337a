"""A rank killed under torchrun ends the whole job promptly, with no rank process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from small_default import write_small_model


def _rank_pids(marker: str) -> dict[int, int]:
    """RANK -> pid of the rank processes whose command line holds ``marker`` (via /proc)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = dict(
                kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv
            )
            cmd = (d / "cmdline").read_text()
        except OSError:
            continue
        if "RANK" in env and "LOCAL_RANK" in env and marker in cmd:
            out[int(env["RANK"])] = int(d.name)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_killed_expert_rank_ends_torchrun_job(tmp_path):
    ckpt = write_small_model(tmp_path / "m", max_position_embeddings=128)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt_token_ids": [1 + i % 50] * 8}) + "\n" for i in range(3000))
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "3",
            "-m",
            "splitmoe.launch",
            "--model",
            str(ckpt),
            "--attention-ranks",
            "1",
            "--prompts",
            str(prompts),
            "--output",
            str(tmp_path / "o.jsonl"),
            "--max-tokens",
            "100",
            "--ignore-eos",
            "--timeout",
            "20",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 60
        pids = {}
        while len(pids) < 3 and time.monotonic() < deadline:
            pids = _rank_pids(str(tmp_path / "o.jsonl"))
            time.sleep(0.2)
        assert len(pids) == 3, f"ranks not found: {pids}"
        time.sleep(4)  # loaded and generating
        assert proc.poll() is None, "the job ended before the kill: make the workload longer"
        os.kill(pids[2], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 30
        assert proc.returncode != 0
        assert "rank 0 (attention) failed" in err or "exitcode" in err
        time.sleep(1)
        assert not [p for p in pids.values() if _alive(p)]
        assert not (tmp_path / "o.jsonl").exists()
    finally:
        proc.kill()
