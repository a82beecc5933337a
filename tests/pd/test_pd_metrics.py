"""Issue 43 item 5: the TTFT split of a pulled request (transfer, first decode step) and the
transfer counters, from the scheduler's pull to ``/metrics``. The end-to-end check (through
the router, on three families) is `test_pd_router.test_metrics_split_the_ttft`."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("mooncake.engine")

from pd.test_connector import BS, Side, run_prompt, schedule_until  # noqa: E402

from splitmoe.outputs import RequestMetrics, RequestOutput  # noqa: E402
from splitmoe.sampling_params import SamplingParams  # noqa: E402
from splitmoe.scheduler.request import RequestSpec  # noqa: E402
from splitmoe.server.metrics import ServerMetrics  # noqa: E402


def samples(body: bytes) -> dict[str, float]:
    """``name{labels}`` -> value, labels other than the model's kept in the name."""
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            extra = {k: v for k, v in s.labels.items() if k != "model_name"}
            key = s.name + ("" if not extra else str(sorted(extra.items())))
            out[key] = s.value
    return out


def test_a_pull_records_its_bytes_and_seconds_in_the_request_metrics():
    pre, dec = Side(32), Side(32)
    prompt = list(range(3, 3 + 19))  # tokens 0 .. 17 pulled: 5 blocks
    run_prompt(pre, 1, prompt, {"transfer_id": "t", "do_remote_decode": True})
    kv = {"transfer_id": "t", "do_remote_prefill": True, "remote_agents": [pre.connector.address]}
    req = dec.sched.add(RequestSpec(9, prompt, SamplingParams(kv_transfer_params=kv), 0.0))
    schedule_until(dec, lambda: req in dec.sched.running)
    pool = dec.cache.pool  # [layers, kv, blocks, block_size, heads, dim]
    block_bytes = pool[0, 0, 0].numel() * pool.element_size()
    blocks = -(-(len(prompt) - 1) // BS)
    expect = blocks * pool.shape[0] * pool.shape[1] * block_bytes
    m = req.metrics()
    assert m.kv_transfer_bytes == expect == dec.connector.counters["kv_transfer_bytes"]
    assert 0 < m.kv_transfer_time == pytest.approx(dec.connector.counters["kv_transfer_seconds"])
    dec.sched.finish(req)
    pre.sched.schedule()


def test_a_request_computed_here_has_no_transfer():
    side = Side(16)
    req = side.sched.add(RequestSpec(1, list(range(3, 12)), SamplingParams(), 0.0))
    side.sched.schedule()
    assert (req.metrics().kv_transfer_time, req.metrics().kv_transfer_bytes) == (0.0, 0)


def output(rid: int, ttft: float, queue: float, transfer: float, nbytes: int) -> RequestOutput:
    m = RequestMetrics(
        arrival_time=0.0,
        queue_time=queue,
        ttft=ttft,
        tpot=0.01,
        e2e_latency=ttft + 0.01,
        num_prompt_tokens=40,
        num_output_tokens=2,
        kv_transfer_time=transfer,
        kv_transfer_bytes=nbytes,
        tbt=(0.01,),
    )
    return RequestOutput(rid, [1] * 40, [5, 6], finish_reason="length", metrics=m)


def test_metrics_split_the_decode_ttft_and_publish_the_transfer_counters():
    sm = ServerMetrics("m")
    sm.finished(output(1, ttft=0.5, queue=0.1, transfer=0.15, nbytes=4096), 1.0)
    sm.finished(output(2, ttft=0.3, queue=0.0, transfer=0.05, nbytes=2048), 1.0)
    sm.finished(output(3, ttft=0.2, queue=0.0, transfer=0.0, nbytes=0), 1.0)  # not pulled
    attn = {"role": "attention", "kv_blocks_used": 0, "kv_blocks_total": 8}
    stats = [
        {**attn, "rank": 0, "kv_transfers": 2, "kv_transfer_bytes": 6144,
         "kv_transfer_seconds": 0.2, "kv_transfer_failures": 1, "kv_parked": 0},
        {**attn, "rank": 1, "kv_transfers": 1, "kv_transfer_bytes": 2048,
         "kv_transfer_seconds": 0.05, "kv_parked": 3, "kv_parked_expired": 2},
        {"role": "expert", "rank": 2, "tokens_served": 10},
    ]  # fmt: skip
    s = samples(sm.scrape(stats, unfinished=0))
    assert s["splitmoe:kv_transfer_time_seconds_count"] == 2
    assert s["splitmoe:kv_transfer_time_seconds_sum"] == pytest.approx(0.2)
    assert s["splitmoe:first_decode_step_seconds_count"] == 2
    assert s["splitmoe:first_decode_step_seconds_sum"] == pytest.approx(0.25 + 0.25)
    assert s["splitmoe:time_to_first_token_seconds_count"] == 3
    assert s["splitmoe:kv_transfers"] == 3
    assert s["splitmoe:kv_transfer_bytes"] == 8192
    assert s["splitmoe:kv_transfer_seconds"] == pytest.approx(0.25)
    assert s["splitmoe:kv_transfer_failures"] == 1
    assert s["splitmoe:kv_parked"] == 3 and s["splitmoe:kv_parked_expired"] == 2
    assert s["splitmoe:kv_transfer_bandwidth_bytes_per_second"] == pytest.approx(8192 / 0.25)


def test_an_instance_without_a_connector_shows_zeros():
    sm = ServerMetrics("m")
    stats = [{"role": "attention", "rank": 0, "kv_blocks_used": 1, "kv_blocks_total": 8}]
    s = samples(sm.scrape(stats, unfinished=0))
    assert s["splitmoe:kv_transfers"] == 0
    assert s["splitmoe:kv_transfer_bandwidth_bytes_per_second"] == 0
