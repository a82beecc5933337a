"""Running ``python -m splitmoe.launch`` jobs from the tests: the request file, the command line,
the launcher processes (several at once for a multi-node job) and the check of the output file
against HF greedy tokens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import prompt_ids

REPO_ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300
DEFAULT_MAX_TOKENS = 8

# (request line, expected max_tokens for it)
LINES = [
    ({"prompt_token_ids": prompt_ids(6, seed=101)}, DEFAULT_MAX_TOKENS),
    ({"prompt_token_ids": prompt_ids(1, seed=102), "max_tokens": 3}, 3),  # per-line override
    ({"prompt_token_ids": prompt_ids(13, seed=103)}, DEFAULT_MAX_TOKENS),
    ({"prompt_token_ids": prompt_ids(2, seed=104)}, DEFAULT_MAX_TOKENS),
]


def launch_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    return env


def launch_args(ckpt, attention_ranks: int, inp: Path, out: Path, *extra: str) -> list[str]:
    """``-m splitmoe.launch ...`` for `LINES`' defaults; ``extra`` options are appended."""
    return [
        "-m",
        "splitmoe.launch",
        "--model",
        str(ckpt),
        "--attention-ranks",
        str(attention_ranks),
        "--prompts",
        str(inp),
        "--output",
        str(out),
        "--max-tokens",
        str(DEFAULT_MAX_TOKENS),
        "--ignore-eos",
        "--dtype",
        "float32",
        *extra,
    ]


def write_input(path: Path) -> None:
    with open(path, "w") as f:
        for req, _ in LINES:
            f.write(json.dumps(req) + "\n")


def run_jobs(cmds: list[list[str]], cwd: Path, timeout_s: float = TIMEOUT_S) -> list[str]:
    """Runs the commands side by side, each in a session of its own with its output in a log
    file under ``cwd`` (a pipe that nobody reads could stall one while the test waits on another),
    and returns their outputs. Fails the test if one exits non-zero or they are not all done in
    ``timeout_s``. As soon as one fails, or at the deadline, what is left is killed, process
    group and all (the ranks a launcher started too): a hang fails the test, it does not block
    it, and a failed node does not leave the other waiting out its rendezvous timeout."""
    logs = [Path(cwd) / f"job{i}.log" for i in range(len(cmds))]
    procs: list[subprocess.Popen] = []
    try:
        for cmd, log in zip(cmds, logs):
            with open(log, "w") as f:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        cwd=str(cwd),
                        env=launch_env(),
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout_s
        codes = [p.poll() for p in procs]
        while None in codes and not any(codes) and time.monotonic() < deadline:
            time.sleep(0.1)
            codes = [p.poll() for p in procs]
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # (its session's group: pgid = its pid)
            except ProcessLookupError:
                pass
            proc.wait()
    outputs = [log.read_text(errors="replace") for log in logs]
    failed = [i for i, c in enumerate(codes) if c]  # (None: still running when killed)
    if failed or None in codes:
        what = f"exit {codes[failed[0]]}" if failed else f"not done in {timeout_s}s"
        logs_text = "".join(
            f"\n--- job {i} (exit {c}): {' '.join(cmd)}\n{out[-4000:]}"
            for i, (cmd, c, out) in enumerate(zip(cmds, codes, outputs))
        )
        pytest.fail(f"launcher {what}{logs_text}")
    return outputs


def read_output(out_path: Path) -> list[dict]:
    """The output file's records, checked for what every line carries: one line per line of
    `LINES`, in order, each run to its ``max_tokens``."""
    assert out_path.exists(), "launcher wrote no output file"
    records = [json.loads(l) for l in out_path.read_text().splitlines() if l.strip()]
    assert len(records) == len(LINES), f"{len(records)} output lines for {len(LINES)} input lines"
    for i, (rec, (req, max_tokens)) in enumerate(zip(records, LINES)):
        for field in ("prompt_token_ids", "token_ids", "text", "finish_reason", "metrics"):
            assert field in rec, f"line {i}: no {field!r} in {sorted(rec)}"
        assert rec["prompt_token_ids"] == req["prompt_token_ids"], (
            f"line {i}: output not in input order"
        )
        assert len(rec["token_ids"]) == max_tokens, f"line {i}: {rec['token_ids']}"
        assert rec["finish_reason"] == "length"
        assert rec["text"] is None or isinstance(rec["text"], str)
        assert isinstance(rec["metrics"], dict)
    return records


def hf_tokens(ckpt, hf_ref) -> list[list[int]]:
    """HF transformers' greedy tokens for every line of `LINES`."""
    return [hf_ref(ckpt, req["prompt_token_ids"], n) for req, n in LINES]


def torchrun(*options: str) -> list[str]:
    """``python -m torch.distributed.run OPTIONS`` (the launch arguments follow)."""
    return [sys.executable, "-m", "torch.distributed.run", *options]
