"""``splitmoe tune-cpu`` (`splitmoe.tune_cpu`): every CPU kernel class of a job, measured
ahead of time and written to the cache file."""

from __future__ import annotations

import json

import torch

from splitmoe.attention_nodes.worker import AttentionWorker
from splitmoe.cli import main as cli_main
from splitmoe.kernels.cpu_choice import CACHE_FILE_NAME
from splitmoe.kernels.settle import Shapes, model_trials
from splitmoe.options import engine_config


def test_tune_cpu_writes_the_file(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """``splitmoe tune-cpu`` measures every class of the job (one attention rank, each kind of
    expert rank) and writes them to the cache file, with a table of the decisions."""
    monkeypatch.setenv("SPLITMOE_CACHE_DIR", str(tmp_path))
    ckpt = str(tiny_ckpt("qwen3_moe"))
    argv = ["tune-cpu", "--model", ckpt, "--dtype", "float32", "--attention-ranks", "1",
            "--expert-ranks", "1", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
            "--max-model-len", "32", "--per-class-s", "0.002", "--max-rounds", "5",
            "--threads-per-rank", "1", "--no-pin-cores"]  # fmt: skip
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    entries = json.loads((tmp_path / CACHE_FILE_NAME).read_text())
    ops = {key.split("|op=")[1].split("|")[0] for key in entries}
    assert ops == {"linear", "decode_attention", "moe_gemm"}
    rows = {tuple(line.split()[:3]) for line in out.splitlines()
            if line.startswith(("linear ", "moe_gemm ", "decode_attention "))}  # fmt: skip
    assert len(rows) == len(entries) and "rank 1 (expert)" in out  # (each class once)
    # a start of that job then finds each class of its attention rank in the file
    cfg = engine_config(
        ckpt, dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=16,
        max_model_len=32, attention_ranks=1, expert_ranks=1, threads_per_rank=1,
    )  # fmt: skip
    worker = AttentionWorker(cfg, object(), torch.device("cpu"))  # (its experts: elsewhere)
    trials = model_trials(Shapes.of(cfg), torch.float32, worker.model)
    assert trials and all(t.choice.key(t.shape, t.dtype) in entries for t in trials)
