"""Expert replicas and the per-step balancer, end to end: the same tokens as HF transformers for
every policy, and a live rebalance changes no output token."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompt_ids

from splitmoe import LLM, SamplingParams
from splitmoe.expert_nodes.experts import LocalExperts
from splitmoe.kernels.backends import moe_backend
from splitmoe.models.config import ModelConfig

PROMPTS = [prompt_ids(n, seed=300 + i) for i, n in enumerate((3, 9, 17, 5, 12, 1))]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _finished(llm: LLM, rids: list[int]) -> dict:
    """The final output of each of ``rids``, polled until all have finished."""
    got = {}
    while len(got) < len(rids):
        for out, _ in llm.poll():
            if out.finished:
                got[out.request_id] = out
    return got


@pytest.mark.parametrize(
    "policy,attention_ranks,expert_ranks,redundant,micro_batches",
    [("static", 1, 2, 2, 1), ("local", 1, 3, 4, 1), ("global", 2, 2, 3, 2)],
)
def test_policies_match_hf(
    tiny_ckpt, hf_ref, policy, attention_ranks, expert_ranks, redundant, micro_batches
):
    ckpt = tiny_ckpt("qwen3_moe")  # 8 experts, top-2
    with LLM(
        str(ckpt),
        attention_ranks=attention_ranks,
        expert_ranks=expert_ranks,
        redundant_experts=redundant,
        balancer=policy,
        micro_batches=micro_batches,
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=16,
    ) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        load = llm.expert_load()
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_ref(ckpt, p, 8)
    # every (token, expert) pair of every step was counted once per MoE layer
    assert len(load["layers"]) == 2
    assert all(sum(row) > 0 for row in load["total"])


def test_rebalance_mid_run_changes_no_token(tiny_ckpt, hf_ref):
    ckpt = tiny_ckpt("qwen3_moe")
    with LLM(
        str(ckpt),
        attention_ranks=2,
        expert_ranks=2,
        redundant_experts=4,
        balancer="global",
        rebalance_interval=3,
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=16,
    ) as llm:
        first = llm.generate(PROMPTS[:3], GREEDY)
        placed = llm.rebalance()
        rids = llm.submit(PROMPTS[3:], GREEDY)
        llm.rebalance()  # while the second batch is running
        got = _finished(llm, rids)
        stats = llm.stats()
    assert placed["placement_version"] >= 1
    assert any(s.get("weights_reloaded") for s in stats if s["role"] == "expert")
    # The global policy's cost comes from the expert ranks' start-up measurement, and every
    # attention rank uses the same one.
    costs = [s["balancer"]["cost"] for s in stats if s["role"] == "attention"]
    measured = stats[0]["balancer"]["measured_cost_s"]
    assert costs[0] == costs[1] and costs[0]["activate"] >= 1
    assert measured["per_pair"] > 0 and measured["per_expert"] >= 0
    outs = first + [got[r] for r in rids]
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_ref(ckpt, p, 8)


@pytest.mark.parametrize("policy", ["static", "local"])
def test_rebalance_mid_run(tiny_ckpt, hf_ref, policy):
    """A new placement mid-run (new replicas, new expert -> slot maps), staged in the
    background and switched layer by layer, reaches the attention rank's dispatch: every token
    still HF's."""
    ckpt = tiny_ckpt("qwen3_moe")
    with LLM(
        str(ckpt),
        attention_ranks=1,
        expert_ranks=2,
        redundant_experts=4,
        balancer=policy,
        device="cpu",
        dtype="float32",  # (the HF oracle's; "auto" is bfloat16 on CPUs with native bf16)
    ) as llm:
        llm.generate(PROMPTS[:2], GREEDY)  # some load to place replicas by
        rids = llm.submit(PROMPTS, GREEDY)
        placed = llm.rebalance()  # while they run
        got = _finished(llm, rids)
        stats = llm.stats()
    assert placed["placement_version"] >= 1
    assert stats[0]["balancer"]["policy"] == policy
    # planned, then switched one changed layer per step boundary, on every rank
    events = [e["event"] for e in stats[0]["balancer"]["rebalance_events"]]
    assert events[:2] == ["begin", "plan"] and events[-1] == "done"
    assert all(e.startswith("switch L") or e == "read" for e in events[2:-1])
    for p, r in zip(PROMPTS, rids):
        assert got[r].token_ids == hf_ref(ckpt, p, 8)


def test_staged_weights_switch_one_layer_at_a_time(tiny_ckpt):
    """`LocalExperts.stage` reads the changed slots' weights without touching the ones being
    served; `apply` installs one layer's."""
    cfg = ModelConfig.from_hf(str(tiny_ckpt("qwen3_moe")))
    layers = cfg.moe_layers
    old = {layer: [0, 1, 2] for layer in layers}
    new = {layer: [0, 5, 2] for layer in layers}
    experts = LocalExperts(
        cfg, old, torch.float32, torch.device("cpu"), moe_backend("torch", torch.device("cpu"))
    )
    before = {layer: [w.clone() for w in experts.weights[layer]] for layer in layers}
    staged = experts.stage(new)
    staged.wait()
    assert staged.changed == {layer: [1] for layer in layers}
    for layer in layers:  # nothing served has changed yet
        assert all(torch.equal(a, b) for a, b in zip(experts.weights[layer], before[layer]))
    assert experts.apply(staged, layers[0]) == 1
    want = LocalExperts(
        cfg, new, torch.float32, torch.device("cpu"), moe_backend("torch", torch.device("cpu"))
    )
    assert all(
        torch.equal(a, b) for a, b in zip(experts.weights[layers[0]], want.weights[layers[0]])
    )
    assert experts.layer_experts == {layers[0]: [0, 5, 2], **{la: old[la] for la in layers[1:]}}
    assert all(torch.equal(a, b) for a, b in zip(experts.weights[layers[1]], before[layers[1]]))
