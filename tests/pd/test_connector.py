"""The Mooncake connector between two schedulers of one process: exact bytes, exact block
ids, blocks freed on both sides whichever way a transfer ends."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("mooncake.engine")

from pd.kv_sides import (  # noqa: E402
    BS,
    KV_SECRET,
    HungAgent,
    Side,
    make_connector,
    mooncake,
    run_prompt,
    schedule_until,
)

from splitmoe.attention_nodes.kv_cache import PagedKVCache  # noqa: E402
from splitmoe.kv_transfer import KVTransferParams, transfer_key  # noqa: E402
from splitmoe.kv_transfer.agent import Granted, Lease, ask  # noqa: E402
from splitmoe.sampling_params import SamplingParams  # noqa: E402
from splitmoe.scheduler.request import RequestSpec  # noqa: E402
from splitmoe.scheduler.window_blocks import NULL_BLOCK  # noqa: E402


@pytest.mark.parametrize("window", [None, 6])
def test_pull_moves_the_exact_blocks_and_frees_both_sides(window):
    pre, dec = Side(32, window), Side(32, window)
    prompt = list(range(3, 3 + 19))  # 19 tokens: 5 blocks, the last one partial
    tables = run_prompt(pre, 1, prompt, {"transfer_id": "t1", "do_remote_decode": True})
    assert pre.used() > 0 and pre.connector.num_parked == 1  # parked, not freed
    kv = {"transfer_id": "t1", "do_remote_prefill": True, "remote_agents": [pre.connector.address]}
    req = dec.sched.add(RequestSpec(9, prompt, SamplingParams(kv_transfer_params=kv), 0.0))
    batch = schedule_until(dec, lambda: req in dec.sched.running)
    assert batch.requests == [req] and batch.num_new_tokens == [1]  # only the last token
    assert req.num_computed_tokens == len(prompt) - 1
    last = -(-(len(prompt) - 1) // BS)
    for k, (src, dst) in enumerate(zip(pre.pools(), dec.pools())):
        mine = req.block_table if k == 0 else req.window_table
        for j in range(last):
            if k == 1 and mine[j] == NULL_BLOCK:
                assert j < (len(prompt) - 1 - window + 1) // BS  # out of every later window
                continue
            assert torch.equal(dst[:, :, mine[j]], src[:, :, tables[k][j]]), (k, j)
    assert dec.connector.counters["kv_transfers"] == 1
    pre.sched.schedule()  # (frees what the agent released)
    assert pre.used() == 0 and pre.connector.num_parked == 0
    dec.sched.finish(req)
    assert dec.used() == 0


def test_n_readers_share_one_parked_prompt():
    pre, dec = Side(32), Side(32)
    prompt = list(range(5, 5 + 9))
    run_prompt(pre, 1, prompt, {"transfer_id": "t", "do_remote_decode": True, "num_readers": 2})
    kv = {"transfer_id": "t", "do_remote_prefill": True, "remote_agents": [pre.connector.address]}
    reqs = [
        dec.sched.add(RequestSpec(i, prompt, SamplingParams(kv_transfer_params=kv), 0.0))
        for i in (1, 2)
    ]
    schedule_until(dec, lambda: all(r in dec.sched.running for r in reqs))
    assert [r.num_computed_tokens for r in reqs] == [8, 8]
    assert dec.connector.counters["kv_transfers"] == 2
    pre.sched.schedule()
    assert pre.used() == 0


def test_a_failed_pull_computes_the_prompt_and_leaks_nothing():
    pre, dec = Side(32), Side(32)
    prompt = list(range(5, 5 + 13))
    dead = make_connector(mooncake(5), PagedKVCache(2, 4, BS, 2, 8, torch.float32, "cpu"))
    address = dead.address
    dead.close()  # nobody answers there any more
    for rid, agents in ((1, [address]), (2, [pre.connector.address])):  # dead / unknown key
        kv = {"transfer_id": f"x{rid}", "do_remote_prefill": True, "remote_agents": agents}
        req = dec.sched.add(RequestSpec(rid, prompt, SamplingParams(kv_transfer_params=kv), 0.0))
        batch = schedule_until(dec, lambda r=req: r in dec.sched.running)
        assert batch.num_new_tokens == [len(prompt)] and req.num_computed_tokens == 0
        assert len(req.block_table) == -(-len(prompt) // BS)
        dec.sched.abort(rid)
        assert dec.used() == 0
    assert dec.connector.counters["kv_transfer_failures"] == 2


def test_a_hung_prefill_side_never_stalls_the_step_loop():
    """A pull that takes long (here: an agent that never answers) runs off the step loop:
    requests computed here keep stepping, the pulling one can be aborted, and its blocks go
    back only once the read has ended (nothing writes a block the pool handed out again)."""
    dec = Side(32, timeout=2.0)
    hung = HungAgent()
    prompt = list(range(5, 5 + 13))
    kv = {"transfer_id": "h", "do_remote_prefill": True, "remote_agents": [hung.address]}
    pulled = dec.sched.add(RequestSpec(1, prompt, SamplingParams(kv_transfer_params=kv), 0.0))
    local = dec.sched.add(RequestSpec(2, prompt, SamplingParams(), 0.0))
    t0 = time.monotonic()
    batch = dec.sched.schedule()
    assert time.monotonic() - t0 < 1.5  # (the pull did not run inline: it takes the 2 s)
    assert batch.requests == [local] and dec.sched.pulling and dec.sched.has_work
    for _ in range(3):  # decode steps of the local request while the pull hangs
        for r, n in zip(batch.requests, batch.num_new_tokens):
            dec.sched.computed(r, n)
            r.output_token_ids.append(7)
        batch = dec.sched.schedule()
        assert batch.requests == [local] and batch.num_new_tokens == [1]
    held = dec.used()
    assert dec.sched.abort(1) is pulled and pulled.finish_reason == "abort"
    assert dec.used() == held  # still being written: not freed yet
    dec.sched.abort(2)
    schedule_until(dec, lambda: not dec.sched.pulling)  # the agent's timeout ends the read
    assert dec.used() == 0 and not dec.sched.has_work
    assert dec.connector.counters["kv_transfer_failures"] == 1
    hung.close()


def test_a_lease_keeps_the_blocks_for_the_whole_read():
    """Parked blocks about to expire get the full timeout again when a reader leases them, and
    a read that outlasts its lease is thrown away (the blocks may have been reused)."""
    pre = Side(32, timeout=0.5)
    prompt = list(range(5, 5 + 13))
    run_prompt(pre, 1, prompt, {"transfer_id": "t", "do_remote_decode": True})
    time.sleep(0.4)
    key = transfer_key("t", prompt)
    lease = ask(pre.connector.address, Lease(key, "r1"), KV_SECRET, time.monotonic() + 5)
    assert isinstance(lease, Granted) and 0.4 < lease.valid_s <= 0.5
    time.sleep(0.2)  # past the park's own deadline, within the lease's
    pre.sched.schedule()
    assert pre.used() > 0 and pre.connector.num_parked == 1
    dec = Side(32, timeout=0.5)
    slow = dec.connector._read
    dec.connector._read = lambda *a: (time.sleep(0.6), slow(*a))[1]
    kv = {"transfer_id": "t", "do_remote_prefill": True, "remote_agents": [pre.connector.address]}
    req = dec.sched.add(RequestSpec(3, prompt, SamplingParams(kv_transfer_params=kv), 0.0))
    schedule_until(dec, lambda: req in dec.sched.running)
    assert req.num_computed_tokens == 0  # computed here: the read came too late to trust
    assert dec.connector.counters["kv_transfer_failures"] == 1


def test_parked_blocks_expire_when_no_decode_instance_comes():
    pre = Side(32, timeout=0.2)
    run_prompt(pre, 1, list(range(5, 5 + 13)), {"transfer_id": "t", "do_remote_decode": True})
    assert pre.used() > 0
    time.sleep(0.3)
    pre.sched.schedule()
    assert pre.used() == 0 and pre.connector.stats()["kv_parked_expired"] == 1


def test_transfer_params_are_checked():
    with pytest.raises(ValueError, match="exactly one"):
        KVTransferParams("t")
    with pytest.raises(ValueError, match="remote_agents"):
        KVTransferParams("t", do_remote_prefill=True)
    with pytest.raises(ValueError, match="host:port"):
        KVTransferParams("t", do_remote_prefill=True, remote_agents=("nohost",))
    with pytest.raises(ValueError, match="unknown key"):
        SamplingParams(kv_transfer_params={"transfer_id": "t", "do_remote_decode": True, "x": 1})
    assert transfer_key("t", [1, 2]) != transfer_key("t", [1, 3])


def test_remote_agents_must_be_trusted():
    """A client cannot point a decode instance's reads at any host: only the networks or names
    of ``kv_trusted_agents`` (loopback by default) pass, before any work starts."""
    from splitmoe.kv_transfer import check_remote_agents

    check_remote_agents(["127.0.0.1:5000", "localhost:1", "[::1]:7"], "127.0.0.0/8,::1,localhost")
    for agent in ("10.1.2.3:80", "169.254.169.254:80", "evil.example:443"):
        with pytest.raises(ValueError, match="kv_trusted_agents"):
            check_remote_agents([agent], "127.0.0.0/8,::1,localhost")
    check_remote_agents(["10.1.2.3:80", "node-7:9"], "10.0.0.0/8, node-7")
    check_remote_agents(["169.254.169.254:80"], "*")
    from splitmoe.config import KVTransferConfig

    with pytest.raises(ValueError, match="no network or host name"):
        KVTransferConfig(kv_trusted_agents="10.0.0.0/8,bad host")


def test_roles_need_a_connector():
    from splitmoe.config import KVTransferConfig

    assert KVTransferConfig().kv_role == "both"
    with pytest.raises(ValueError, match="kv_connector='mooncake'"):
        KVTransferConfig(kv_role="prefill")
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig(kv_role="decoder", kv_connector="mooncake")
    assert KVTransferConfig(kv_role="decode", kv_connector="mooncake").kv_connector == "mooncake"
