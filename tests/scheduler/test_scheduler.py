"""Block allocation and per-step token plans (exact block ids, CPU only)."""

from __future__ import annotations

from splitmoe.config import SchedulerConfig
from splitmoe.sampling_params import SamplingParams
from splitmoe.scheduler.block_manager import BlockManager
from splitmoe.scheduler.request import RequestSpec
from splitmoe.scheduler.router import LeastLoadRouter
from splitmoe.scheduler.scheduler import Scheduler


def _spec(rid, n, max_tokens=4):
    return RequestSpec(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), 0.0)


def _step(s: Scheduler, sampled_token=7):
    """Runs one planned step the way the attention worker does, without a model."""
    batch = s.schedule()
    plan = {r.request_id: n for r, n in zip(batch.requests, batch.num_new_tokens)}
    for req, n in zip(batch.requests, batch.num_new_tokens):
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(sampled_token, 0.0)
            if req.finish_reason:
                s.finish(req)
    return plan


def test_block_manager_exact_ids_and_reuse():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = [], []
    assert bm.grow(a, 5) and a == [0, 1]
    assert bm.grow(b, 4) and b == [2]
    assert not bm.grow(b, 9)  # needs 2 more, 1 free: nothing taken
    assert b == [2] and bm.num_free == 1
    bm.free(a)
    assert a == [] and bm.num_free == 3
    assert bm.grow(b, 12) and b == [2, 0, 1]  # a's blocks first, in a's order, then fresh ones
    bm.free(b)
    assert bm.grow(a, 16) and a == [2, 0, 1, 3]


def test_decodes_first_then_prompt_chunks_under_budget():
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8),
        BlockManager(64, 4),
        eos_token_ids=(),
        max_model_len=100,
    )
    s.add(_spec(0, 3, max_tokens=10))
    assert _step(s) == {0: 3}  # prefill, first token sampled
    s.add(_spec(1, 20))
    # the running request decodes 1 token; the long prompt gets the remaining budget, chunked
    assert _step(s) == {0: 1, 1: 7}
    assert _step(s) == {0: 1, 1: 7}
    assert _step(s) == {0: 1, 1: 6}
    assert s.running[1].output_token_ids == [7]  # prompt done: its first token was sampled


def test_max_num_seqs_caps_admission():
    s = Scheduler(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100),
        BlockManager(64, 4),
        eos_token_ids=(),
        max_model_len=100,
    )
    for i in range(3):
        s.add(_spec(i, 2))
    assert _step(s) == {0: 2, 1: 2}
    assert len(s.waiting) == 1


def test_finished_requests_free_blocks_and_admit_waiting():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        bm,
        eos_token_ids=(),
        max_model_len=100,
    )
    s.add(_spec(0, 4, max_tokens=2))
    s.add(_spec(1, 4, max_tokens=2))
    assert _step(s) == {0: 4, 1: 4}  # both prompts fill one block each
    assert bm.num_free == 0
    s.add(_spec(2, 3, max_tokens=1))
    # decoding needs a second block per request: the newest one is preempted, not dropped
    plan = _step(s)
    assert plan == {0: 1}
    assert [r.request_id for r in s.waiting][:1] == [1]
    assert s.num_preemptions == 1
    for _ in range(20):
        _step(s)
        if not s.has_work:
            break
    assert not s.has_work and bm.num_free == 2


def test_stop_token_and_eos():
    s = Scheduler(SchedulerConfig(), BlockManager(16, 4), eos_token_ids=(7,), max_model_len=100)
    r = s.add(_spec(0, 2, max_tokens=10))
    _step(s, sampled_token=7)
    assert r.finish_reason == "stop" and r.output_token_ids == [7]
    r2 = s.add(RequestSpec(1, [1], SamplingParams(max_tokens=3, ignore_eos=True), 0.0))
    for _ in range(3):
        _step(s, sampled_token=7)
    assert r2.finish_reason == "length" and r2.output_token_ids == [7, 7, 7]


def test_router_least_load_deterministic():
    r = LeastLoadRouter(3)
    assert [r.pick(c) for c in (10, 5, 5, 1, 20)] == [0, 1, 2, 1, 2]
    r.release(0, 10)
    assert r.pick(1) == 0
