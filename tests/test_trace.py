"""Per-step timelines (`LLM.trace`) and their Chrome trace: what a user reads the overlap from."""

from __future__ import annotations

import json

import pytest
from tiny_models import prompt_ids

from splitmoe import LLM, SamplingParams
from splitmoe.models.config import ModelConfig
from splitmoe.timeline import KINDS, breakdown, chrome_trace

PROMPTS = [prompt_ids(n, seed=120 + i) for i, n in enumerate((5, 9, 3, 12))]


def test_trace_shows_every_micro_batch_of_every_layer(tiny_ckpt):
    ckpt = tiny_ckpt("qwen3_moe")
    layers = ModelConfig.from_hf(str(ckpt)).num_layers
    with LLM(str(ckpt), attention_ranks=1, expert_ranks=1, micro_batches=2, device="cpu") as llm:
        llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        traces = llm.trace()
    assert [(t["rank"], t["role"]) for t in traces] == [(0, "attention"), (1, "expert")]
    attention, expert = (t["timeline"] for t in traces)
    step = max(s.step for s in attention) - 1  # a decode step with every request still running
    att = [s for s in attention if s.step == step]
    exp = [s for s in expert if s.step == step]
    names = [s.name for s in att]
    for layer in range(layers):  # one dispatch and one combine per micro-batch and layer
        assert names.count(f"dispatch L{layer}") == 2
        assert names.count(f"combine L{layer}") == 2
    for name in ("forward m=2", "sample", "schedule", "sync"):
        assert name in names
    assert names.count("inputs") == 2  # each micro-batch's inputs, packed when layer 0 needs them
    # the expert rank serves micro-batch 0 then 1 of each layer, in arrival order
    served = [s.name for s in exp if s.kind == "compute"]
    assert served == [f"experts L{layer}.{j}" for layer in range(layers) for j in (0, 1)]
    for spans in (att, exp):
        assert all(s.kind in KINDS and s.end >= s.start for s in spans)
        b = breakdown(spans)  # spans nested in the forward are counted once
        assert min(b[k] for k in KINDS) >= 0.0
        assert sum(b[k] for k in KINDS) <= b["wall"] * (1 + 1e-9)
    # dispatching micro-batch 0 of layer 0 comes before the expert computes it
    first_dispatch = min(s.start for s in att if s.name == "dispatch L0")
    first_experts = min(s.start for s in exp if s.name == "experts L0.0")
    assert first_dispatch < first_experts
    trace = json.loads(json.dumps(chrome_trace({0: att, 1: exp}, {0: "attention", 1: "expert"})))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(att) + len(exp)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 and e["cat"] in KINDS for e in events)


def _trace_step_args(ckpt):
    """`scripts/trace_step.py`'s options for a short traced run of ``ckpt``."""
    from argparse import Namespace

    return Namespace(
        model=str(ckpt), transport="flat", threads_per_rank=None, batch=4, max_tokens=8, steps=4,
        dtype="float32",
    )  # fmt: skip


def test_trace_step_compares_counts(tiny_ckpt):
    """`scripts/trace_step.py`'s figures of one run: per rank and step, compute / comm / wait
    adding up to the step, the expert compute per micro-batch, and the counts ``auto`` ran."""
    from scripts.trace_step import run, summarize

    ckpt = tiny_ckpt("qwen3_moe")
    result = run(_trace_step_args(ckpt), PROMPTS, (1, 1), "auto")
    s = summarize(result)
    assert result["steps"] == 4 and sum(s["used"].values()) == 4
    assert set(s["used"]) <= {1, 2, 3, 4}
    attention, expert = s["ranks"][0], s["ranks"][1]
    for r in (attention, expert):
        assert min(r[k] for k in (*KINDS, "other")) >= 0.0
        assert sum(r[k] for k in (*KINDS, "other")) == pytest.approx(r["wall"])
    assert s["step_ms"] == attention["wall"] > 0.0
    assert "per_micro_batch" not in attention
    # the expert rank computes once per micro-batch and MoE layer: its compute, so divided
    layers = len(ModelConfig.from_hf(str(ckpt)).moe_layers)
    served = sum(m * n for m, n in s["used"].items()) * layers
    assert expert["per_micro_batch"] * served == pytest.approx(expert["compute"] * 4, rel=1e-6)


def test_trace_step_runs_colocated_micro_batches(tiny_ckpt):
    """A colocated topology (``1+0``) runs the count it is given: two micro-batches on every
    traced step, one rank."""
    from scripts.trace_step import run, summarize

    s = summarize(run(_trace_step_args(tiny_ckpt("qwen3_moe")), PROMPTS, (1, 0), 2))
    assert s["used"] == {2: 4} and list(s["ranks"]) == [0]
    assert s["step_ms"] == s["ranks"][0]["wall"] > 0.0
