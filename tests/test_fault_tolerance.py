"""Fault tolerance (issues 42, 65): ranks killed (SIGKILL) or stopped (SIGSTOP: alive and silent)
mid-decode, and the job goes on.

Tiny Qwen3-MoE (8 experts, top-2, 2 MoE layers), float32: every request in flight finishes
once, with exactly HF transformers' greedy tokens (those of a run without the failure),
whether the lost rank's experts all have replicas on the survivors, are read again from the
checkpoint into replica slots or into slots the survivors grow; with no room for a lost expert
the job ends with `RankFailure`. A stopped rank is noticed within ``timeout_s``, left out of
the membership whichever rank it is (attention rank 0 included), and ended by the front end.
48 requests rather than the issue's 64: the same batch shape class (one decode step for all of
them) at three quarters of the HF reference's cost on 2 shared cores.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from tiny_models import cpu_llm, prompt_ids

from splitmoe import SamplingParams
from splitmoe.llm import RankFailure
from splitmoe.memory import engine_memory
from splitmoe.models.default_model import write_default_model
from splitmoe.options import engine_config

N_REQUESTS = 48
MAX_TOKENS = 12
PROMPTS = [prompt_ids(3 + i % 11, seed=4200 + i) for i in range(N_REQUESTS)]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


# A stopped rank is noticed only when a peer's wait for it times out, and the survivors then
# wait as long again for it to check in (`agree_membership`): tests that stop one keep it short
STOP_TIMEOUT_S = 3


def _kill_mid_decode(llm, rank: int) -> tuple[dict, float]:
    return _fault_mid_decode(llm, {rank: signal.SIGKILL})


def _fault_mid_decode(llm, faults: dict[int, signal.Signals]) -> tuple[dict, float]:
    """Submits every prompt, sends each rank of ``faults`` its signal (SIGKILL: it dies;
    SIGSTOP: it stops answering but lives) once every request has decoded a few tokens, and
    polls to the end; returns each request's final output (each seen finished exactly once)
    and the seconds from the fault to the first step completed after the recovery (the
    interrupted one, replayed: the survivors report the recovery before they replay it)."""
    rids = llm.submit(PROMPTS, GREEDY)
    tokens = {rid: [] for rid in rids}
    finished: dict = {}
    faulted_at = recovered_in = None
    while len(finished) < len(rids):
        for out, new in llm.poll():
            tokens[out.request_id] += new
            if out.finished:
                assert out.request_id not in finished, "a request finished twice"
                finished[out.request_id] = out
            if faulted_at is not None and recovered_in is None and new and llm.recoveries:
                recovered_in = time.monotonic() - faulted_at
        if faulted_at is None and all(len(t) >= 3 for t in tokens.values()):
            assert not finished, "requests finished before the fault: raise MAX_TOKENS"
            for rank, sig in faults.items():
                os.kill(llm.rank_pids[rank], sig)
            faulted_at = time.monotonic()
    assert faulted_at is not None and recovered_in is not None
    for rid, out in finished.items():
        assert out.token_ids == tokens[rid], "streamed tokens differ from the final output"
    return {rid: finished[rid] for rid in rids}, recovered_in


def _assert_ended(llm, rank: int) -> None:
    """Rank ``rank``'s process was killed by the front end and reaped: not left stopped, nor a
    zombie."""
    proc = llm.engine.procs.procs[rank]
    assert proc.exitcode == -signal.SIGKILL, proc.exitcode
    assert not os.path.exists(f"/proc/{proc.pid}"), "the ended rank was not reaped"


@pytest.mark.parametrize(
    "lost,read_again,shared_memory,timeout_s",
    [
        # expert rank 2 of 3 holds only replicas (experts 0-3 of slots 8-11)
        (3, False, True, 20),
        # expert rank 1 holds experts 4-7, replicated nowhere: read from the checkpoint
        (2, True, True, 20),
        # over gloo: a rank blocked in a send to a live peer sees the failure only when the
        # send times out (timeout_s), hence a short one
        (2, True, False, 8),
    ],
)
def test_expert_rank_killed_mid_decode(
    tiny_ckpt, hf_ref, lost, read_again, shared_memory, timeout_s
):
    ckpt = tiny_ckpt("qwen3_moe")  # 8 experts, top-2
    with cpu_llm(
        ckpt,
        1,
        3,
        redundant_experts=4,
        fault_tolerance=True,
        shared_memory=shared_memory,
        timeout_s=timeout_s,
    ) as llm:
        outs, recovered_in = _kill_mid_decode(llm, lost)
        stats = llm.stats()
        recoveries = llm.recoveries
        health = llm.health
    print(
        f"kill of rank {lost} -> next completed step: {recovered_in:.2f} s "
        f"(recovery on rank 0: {recoveries[0]['seconds']:.2f} s)"
    )
    for p, out in zip(PROMPTS, outs.values()):
        assert out.token_ids == hf_ref(ckpt, p, MAX_TOKENS)
        assert out.finish_reason == "length"
    assert health == "ok"
    assert [r["lost"] for r in recoveries] == [[lost]]
    members = [r for r in range(4) if r != lost]
    assert recoveries[0]["members"] == members
    assert [s["rank"] for s in stats] == members
    assert all(s["membership"]["members"] == members for s in stats)
    experts = [s for s in stats if s["role"] == "expert"]
    read = [s["membership"]["recoveries"][0]["weights_read"] for s in experts]
    assert (sum(read) > 0) == read_again
    # every expert of every MoE layer is held by some survivor, in 8 slots over two ranks
    for layer in ("0", "1"):
        held = sorted(e for s in experts for e in s["slots"][layer])
        assert held == list(range(8))
    assert all(s["kv_blocks_used"] == 0 for s in stats if s["role"] == "attention")


def _expert_rank_bytes(ckpt, expert_ranks: int) -> int:
    """What one expert rank of a 1 + ``expert_ranks`` job on ``ckpt`` holds (no replicas)."""
    cfg = engine_config(
        str(ckpt), attention_ranks=1, expert_ranks=expert_ranks, dtype="float32", device="cpu"
    )
    return engine_memory(cfg).role("expert")[0].total


def test_expert_that_fits_nowhere_ends_the_job(tiny_ckpt):
    """No replica slots, and a memory budget (``expert_memory_gb``) that holds an expert rank's
    4 slots per layer but not the 8 the survivor would need: a lost expert rank's experts fit
    nowhere, and the job ends with `RankFailure` naming the cause, as without fault
    tolerance."""
    ckpt = tiny_ckpt("qwen3_moe")
    budget = (_expert_rank_bytes(ckpt, 2) + _expert_rank_bytes(ckpt, 1)) / 2 / 2**30
    with pytest.raises(RankFailure, match="no survivor has a replica slot") as failure:
        with cpu_llm(
            ckpt, 1, 2, fault_tolerance=True, timeout_s=20, expert_memory_gb=budget
        ) as llm:
            _kill_mid_decode(llm, 2)
    assert "over expert_memory_gb" in str(failure.value)


@pytest.mark.parametrize("lost", [1, 0])
def test_attention_rank_killed_mid_decode(tiny_ckpt, hf_ref, lost):
    """2 attention + 2 expert ranks, one attention rank killed mid-decode (rank 0 too: the
    membership's leader is then the next one): its requests resume on the other from their
    prompt plus the tokens already streamed; every request finishes once with HF's greedy
    tokens, each stream adds up to its output (no token repeated or missing), no KV block is
    left held, and the job takes new requests after it."""
    ckpt = tiny_ckpt("qwen3_moe")
    with cpu_llm(ckpt, 2, 2, fault_tolerance=True, timeout_s=20) as llm:
        outs, recovered_in = _kill_mid_decode(llm, lost)
        after = llm.generate(PROMPTS[:4], GREEDY)  # (served by the survivor)
        stats = llm.stats()
        recoveries = llm.recoveries
        health = llm.health
    print(f"kill of attention rank {lost} -> next completed step: {recovered_in:.2f} s")
    for p, out in zip(PROMPTS, outs.values()):
        assert out.token_ids == hf_ref(ckpt, p, MAX_TOKENS)
        assert out.finish_reason == "length" and out.metrics.num_output_tokens == MAX_TOKENS
    for p, out in zip(PROMPTS, after):
        assert out.token_ids == hf_ref(ckpt, p, MAX_TOKENS)
    survivor = 1 - lost
    assert all(out.attention_rank == survivor for out in after)
    assert all(out.attention_rank == survivor for out in outs.values())  # (half were moved)
    assert health == "ok"
    assert [r["lost"] for r in recoveries] == [[lost]]
    members = [r for r in range(4) if r != lost]
    assert [s["rank"] for s in stats] == members
    assert [s["role"] for s in stats] == ["attention", "expert", "expert"]
    assert stats[0]["kv_blocks_used"] == 0 and stats[0]["running"] == 0


def test_losing_every_attention_rank_ends_the_job(tiny_ckpt):
    """With one attention rank, losing it leaves nobody to serve: `RankFailure`."""
    ckpt = tiny_ckpt("qwen3_moe")
    with pytest.raises(RankFailure, match="rank 0 \\(attention\\)"):
        with cpu_llm(ckpt, 1, 2, fault_tolerance=True, timeout_s=20) as llm:
            _kill_mid_decode(llm, 0)


@pytest.mark.parametrize(
    "attention,experts,redundant,victim",
    [
        (1, 3, 4, 3),  # an expert rank whose experts all have replicas on the others
        (2, 2, 0, 0),  # attention rank 0, the lowest rank: no survivor waits for it to lead
    ],
)
def test_stopped_rank_is_evicted_and_ended(
    tiny_ckpt, hf_ref, attention, experts, redundant, victim
):
    """A rank stopped mid-decode (SIGSTOP: its process lives, it answers nothing) is a lost
    rank: its peers' waits time out within ``timeout_s``, the survivors agree without it, the
    front end kills the stopped process and reaps it, a lost attention rank's requests resume
    on the other, and every request finishes once with HF's greedy tokens; the job serves
    new requests after it."""
    ckpt = tiny_ckpt("qwen3_moe")
    with cpu_llm(
        ckpt,
        attention,
        experts,
        redundant_experts=redundant,
        fault_tolerance=True,
        timeout_s=STOP_TIMEOUT_S,
    ) as llm:
        outs, recovered_in = _fault_mid_decode(llm, {victim: signal.SIGSTOP})
        _assert_ended(llm, victim)
        after = llm.generate(PROMPTS[:4], GREEDY)
        recoveries = llm.recoveries
        health = llm.health
    print(f"stop of rank {victim} -> next completed step: {recovered_in:.2f} s")
    for p, out in zip(PROMPTS, outs.values()):
        assert out.token_ids == hf_ref(ckpt, p, MAX_TOKENS)
        assert out.finish_reason == "length" and out.metrics.num_output_tokens == MAX_TOKENS
    for p, out in zip(PROMPTS, after):
        assert out.token_ids == hf_ref(ckpt, p, MAX_TOKENS)
    assert health == "ok"
    assert [r["lost"] for r in recoveries] == [[victim]]
    assert recoveries[0]["members"] == [r for r in range(attention + experts) if r != victim]
    if victim < attention:  # (its requests resumed on the other attention rank)
        assert all(out.attention_rank == 1 for out in [*outs.values(), *after])


def test_expert_rank_lost_without_spare_slots_grows_the_survivors(tmp_path):
    """The built-in default model (16 experts, 4 MoE layers) on 1 + 3 ranks with no replica
    slots (6 + 5 + 5 per layer), expert rank 1 killed mid-decode: its 5 experts fit no replica
    slot, so the two survivors grow to 8 slots each and read them from the checkpoint; every
    request finishes once with the tokens of the same job's run before the failure."""
    ckpt = write_default_model(tmp_path / "default")
    with cpu_llm(ckpt, 1, 3, fault_tolerance=True, timeout_s=20) as llm:
        before = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        outs, recovered_in = _kill_mid_decode(llm, 2)
        after = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
        stats = llm.stats()
        recoveries = llm.recoveries
    print(f"kill of expert rank 2 (no spare slot) -> next completed step: {recovered_in:.2f} s")
    assert [out.token_ids for out in outs.values()] == [out.token_ids for out in before]
    assert [out.token_ids for out in after] == [out.token_ids for out in before[:4]]
    assert [r["lost"] for r in recoveries] == [[2]]
    assert recoveries[0]["expert_slots"] == [8, 8]
    experts = [s for s in stats if s["role"] == "expert"]
    assert [s["rank"] for s in experts] == [1, 3]
    for layer in ("0", "1", "2", "3"):  # (each expert once: no replica was made)
        assert sorted(e for s in experts for e in s["slots"][layer]) == list(range(16))
    read = [s["membership"]["recoveries"][0]["weights_read"] for s in experts]
    assert read == [2 * 4, 3 * 4]  # (the new slots only: 2 and 3 per layer)


def test_expert_and_attention_rank_lost_at_once(tiny_ckpt, hf_ref):
    """2 + 2 ranks without replica slots; at once, attention rank 0 stops (SIGSTOP) and expert
    rank 1 (rank 3) is killed: the survivors (one of each role) agree without both, the
    expert survivor grows to every expert, attention rank 1 takes rank 0's requests, the
    front end ends the stopped process, and every request finishes once with HF's tokens."""
    ckpt = tiny_ckpt("qwen3_moe")
    with cpu_llm(ckpt, 2, 2, fault_tolerance=True, timeout_s=STOP_TIMEOUT_S) as llm:
        outs, recovered_in = _fault_mid_decode(llm, {0: signal.SIGSTOP, 3: signal.SIGKILL})
        _assert_ended(llm, 0)
        after = llm.generate(PROMPTS[:4], GREEDY)
        stats = llm.stats()
        recoveries = llm.recoveries
    print(f"stop of rank 0 + kill of rank 3 -> next completed step: {recovered_in:.2f} s")
    for p, out in zip(PROMPTS, outs.values()):
        assert out.token_ids == hf_ref(ckpt, p, MAX_TOKENS)
    for p, out in zip(PROMPTS, after):
        assert out.token_ids == hf_ref(ckpt, p, MAX_TOKENS)
    assert [r["lost"] for r in recoveries] == [[0, 3]]
    assert [(s["rank"], s["role"]) for s in stats] == [(1, "attention"), (2, "expert")]
    assert recoveries[0]["expert_slots"] == [8]
    assert all(out.attention_rank == 1 for out in [*outs.values(), *after])
