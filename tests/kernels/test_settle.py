"""A rank's kernel choices settled before it serves (`splitmoe.kernels.settle`): the classes
it lists are the ones its model meets."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from splitmoe import SamplingParams
from splitmoe.attention_nodes.worker import AttentionWorker
from splitmoe.comm.topology import Topology
from splitmoe.expert_nodes.experts import LocalExperts
from splitmoe.kernels.backends import moe_backend
from splitmoe.kernels.cpu_choice import DEFAULT_FILE, defaulted_classes, settle, unsettled
from splitmoe.kernels.settle import (
    Shapes,
    model_trials,
    settle_cpu_kernels,
)
from splitmoe.options import engine_config
from splitmoe.scheduler.request import RequestSpec


def _rank0(cfg) -> Topology:
    return Topology.build(0, cfg.parallel, cfg.model.num_experts)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "glm4_moe"])
def test_serving_meets_only_settled_classes(tiny_ckpt, tmp_path, monkeypatch, family):
    """A colocated attention rank settled with no time limit then serves prompts of many
    lengths and batches (prefill chunks, decode, a sliding window, MLA, a dense layer): no
    call meets a class the settle step did not decide."""
    monkeypatch.setenv("SPLITMOE_CACHE_DIR", str(tmp_path))
    cfg = engine_config(
        str(tiny_ckpt(family)), dtype="float32", device="cpu", max_num_seqs=6,
        max_num_batched_tokens=48, block_size=4, max_model_len=96, timeout_s=600,
        kernel_settle_s=None,  # (and timeout_s: no cap however loaded the host)
    )  # fmt: skip
    worker = AttentionWorker(cfg, None, torch.device("cpu"))
    report = settle_cpu_kernels(cfg, worker, _rank0(cfg))
    assert report.left == [] and len(report.classes) > 10
    before = set(defaulted_classes())
    g = torch.Generator().manual_seed(0)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    rid = 0
    for batch, prompt in [(1, 5), (6, 3), (3, 41), (2, 70)]:
        for _ in range(batch):
            rid += 1
            ids = torch.randint(3, cfg.model.vocab_size, (prompt,), generator=g).tolist()
            assert worker.add_request(RequestSpec(rid, ids, greedy, time.time())) is None
        for step in range(300):  # (steps of one and of two micro-batches, alternately)
            if not worker.has_work or not worker.plan():
                break
            worker.execute(1 + step % 2)
    assert not worker.has_work
    assert set(defaulted_classes()) - before == set()


def test_an_expert_rank_meets_only_settled_classes(tiny_ckpt, tmp_path, monkeypatch):
    """An expert rank's experts (a share of them) take tokens of every attention rank, each
    with some of its slots elsewhere (-1): every call's class was settled."""
    monkeypatch.setenv("SPLITMOE_CACHE_DIR", str(tmp_path))
    cfg = engine_config(
        str(tiny_ckpt("qwen3_moe")), dtype="float32", device="cpu", attention_ranks=2,
        expert_ranks=2, max_num_batched_tokens=24,
    )  # fmt: skip
    m, cpu = cfg.model, torch.device("cpu")
    held = list(range(0, m.num_experts, 2))
    experts = LocalExperts(m, held, torch.float32, cpu, moe_backend("torch", cpu))
    shapes = Shapes.of(cfg, expert_rank=True)
    assert shapes.expert_tokens == 48 and not shapes.all_slots_local
    assert settle(model_trials(shapes, torch.float32, None, experts)).left == []
    before = set(defaulted_classes())
    g = torch.Generator().manual_seed(1)
    for tokens in (1, 2, 5, 9, 17, 30, 48):
        ids = torch.randint(-len(held), len(held), (tokens, m.top_k), generator=g)
        ids = ids.clamp(min=-1).to(torch.int32)  # (about half the slots elsewhere)
        w = torch.rand(tokens, m.top_k, generator=g)
        for layer in experts.layer_experts:
            experts.compute(layer, torch.randn(tokens, m.hidden_size, generator=g), ids, w)
    assert set(defaulted_classes()) - before == set()


def test_a_rank_is_settled_within_its_budget(tiny_ckpt, tmp_path, monkeypatch):
    """The settle step of a rank ends within its budget, its wait for the machine's turn
    included: with another process measuring all along, it measures nothing, and the classes
    it had to measure run their default."""
    monkeypatch.setenv("SPLITMOE_CACHE_DIR", str(tmp_path))
    ckpt = str(tiny_ckpt("qwen3_moe", num_experts=6))  # (experts of shapes no other test has)
    cfg = engine_config(ckpt, dtype="float32", device="cpu", max_num_seqs=4,
                        max_num_batched_tokens=32, kernel_settle_s=0.3)  # fmt: skip
    worker = AttentionWorker(cfg, None, torch.device("cpu"))
    todo = len(unsettled(model_trials(Shapes.of(cfg), torch.float32, worker.model, worker.experts)))
    assert todo > 0
    with type(DEFAULT_FILE)(DEFAULT_FILE.path).turn() as busy:  # (another rank's turn)
        assert busy
        t = time.perf_counter()
        report = settle_cpu_kernels(cfg, worker, _rank0(cfg))
        assert time.perf_counter() - t < 0.3 + 0.5  # (a loaded host's scheduling: slack)
        assert len(report.left) == todo
        # however long a budget, half the job's timeout at most (the other ranks wait in a
        # collective that would time out)
        short = replace(cfg, kernel_settle_s=None, parallel=replace(cfg.parallel, timeout_s=0.6))
        t = time.perf_counter()
        assert len(settle_cpu_kernels(short, worker, _rank0(short)).left) == todo
        assert time.perf_counter() - t < 0.3 + 0.5
    cfg = replace(cfg, kernel_settle_s=1.0)  # its turn now: it measures, within 1 s
    t = time.perf_counter()
    report = settle_cpu_kernels(cfg, worker, _rank0(cfg))
    assert time.perf_counter() - t < 1.0 + 0.5 and len(report.left) < todo


def test_the_budget_is_an_engine_option(tiny_ckpt):
    ckpt = str(tiny_ckpt("qwen3_moe"))
    assert engine_config(ckpt, device="cpu").kernel_settle_s == 5.0
    assert engine_config(ckpt, device="cpu", kernel_settle_s=None).kernel_settle_s is None
    for bad in (-1, float("nan"), True):
        with pytest.raises(ValueError, match="kernel_settle_s"):
            engine_config(ckpt, device="cpu", kernel_settle_s=bad)
