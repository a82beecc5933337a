"""The multi-process launcher (``python -m splitmoe.launch``) started by
torchrun or by mpirun: JSONL in, JSONL out, greedy tokens equal to HF's."""

from __future__ import annotations

import shutil
import sys

import pytest
from launch_jobs import hf_tokens, launch_args, read_output, run_jobs, torchrun, write_input


def _torchrun(nproc, attention_ranks, tmp_path, ckpt, hf_ref):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp)
    cmd = torchrun("--standalone", "--nproc-per-node", str(nproc)) + launch_args(
        ckpt, attention_ranks, inp, out
    )
    run_jobs([cmd], tmp_path)
    assert [r["token_ids"] for r in read_output(out)] == hf_tokens(ckpt, hf_ref)


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
    write_input(inp)
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
    ] + launch_args(ckpt, 1, inp, out)
    run_jobs([cmd], tmp_path)
    assert [r["token_ids"] for r in read_output(out)] == hf_tokens(ckpt, hf_ref)
