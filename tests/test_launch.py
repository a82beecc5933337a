"""The multi-process launcher (``python -m splitmoe.launch``) started by
torchrun or by mpirun: JSONL in, JSONL out, greedy tokens equal to HF's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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


def _env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    return env


def _launch_args(ckpt, attention_ranks, inp, out):
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
    ]


def _write_input(path: Path):
    with open(path, "w") as f:
        for req, _ in LINES:
            f.write(json.dumps(req) + "\n")


def _run(cmd, tmp_path):
    try:
        proc = subprocess.run(
            cmd,
            cwd=str(tmp_path),
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=TIMEOUT_S,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as e:
        out = e.output if isinstance(e.output, str) else (e.output or b"").decode(errors="replace")
        pytest.fail(f"launcher did not finish in {TIMEOUT_S}s: {' '.join(cmd)}\n{out[-4000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-6000:]}"
    return proc


def _check_output(out_path: Path, ckpt, hf_ref):
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
        want = hf_ref(ckpt, req["prompt_token_ids"], max_tokens)
        assert rec["token_ids"] == want, f"line {i}: splitmoe {rec['token_ids']} != HF {want}"


def _torchrun(nproc, attention_ranks, tmp_path, ckpt, hf_ref):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(inp)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
    ] + _launch_args(ckpt, attention_ranks, inp, out)
    _run(cmd, tmp_path)
    _check_output(out, ckpt, hf_ref)


def test_torchrun_1_attention_2_expert(tmp_path, tiny_ckpt, hf_ref):
    _torchrun(3, 1, tmp_path, tiny_ckpt("qwen3_moe"), hf_ref)


def test_torchrun_2_attention_2_expert(tmp_path, tiny_ckpt, hf_ref):
    _torchrun(4, 2, tmp_path, tiny_ckpt("qwen2_moe"), hf_ref)


def test_mpirun_1_attention_2_expert(tmp_path, tiny_ckpt, hf_ref):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not on PATH")
    ckpt = tiny_ckpt("qwen3_moe")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(inp)
    cmd = [
        mpirun,
        "--allow-run-as-root",
        "--oversubscribe",
        "-n",
        "3",
        "-x",
        "OMP_NUM_THREADS",
        "-x",
        "PYTHONPATH",
        sys.executable,
    ] + _launch_args(ckpt, 1, inp, out)
    _run(cmd, tmp_path)
    _check_output(out, ckpt, hf_ref)
