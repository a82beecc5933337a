"""Rank processes never outlive the job: on close, on a rank's death, on Ctrl-C or a killed
front end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from small_default import write_small_model

from splitmoe import LLM, RankFailure, SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_small_model(tmp_path_factory.mktemp("small"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids, timeout=20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return left


def test_close_leaves_no_process(ckpt):
    llm = LLM(str(ckpt), attention_ranks=1, expert_ranks=2, device="cpu")
    pids = list(llm.rank_pids)
    assert len(pids) == 3
    llm.generate([[1, 2]], SamplingParams(max_tokens=3))
    llm.close()
    llm.close()  # idempotent
    assert _wait_gone(pids) == []
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1]])
    with pytest.raises(RuntimeError, match="closed"):
        llm.stats()


@pytest.mark.parametrize("victim,role", [(2, "expert"), (0, "attention")])
def test_dead_rank_fails_generate_and_stops_all(ckpt, victim, role):
    llm = LLM(str(ckpt), attention_ranks=1, expert_ranks=2, device="cpu", timeout_s=30)
    pids = list(llm.rank_pids)
    os.kill(pids[victim], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=rf"rank {victim} \({role}\) died \(killed by SIGKILL\)"):
        llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=20))
    assert time.monotonic() - start < 30
    assert _wait_gone(pids) == []


_SCRIPT = textwrap.dedent(
    """
    import faulthandler, signal, sys
    from splitmoe import LLM, SamplingParams
    if __name__ == "__main__":
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # (the test's view of a hang)
        llm = LLM(sys.argv[1], attention_ranks=1, expert_ranks=1, device="cpu")
        print(" ".join(map(str, llm.rank_pids)), flush=True)
        while True:
            llm.generate([[1, 2, 3]] * 8, SamplingParams(max_tokens=40, ignore_eos=True))
    """
)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_or_killed_front_end_takes_ranks_down(ckpt, tmp_path, sig):
    script = tmp_path / "serve.py"
    script.write_text(_SCRIPT)
    # The front end as started from a terminal, where Ctrl-C is live: a run started in the
    # background by a non-interactive shell (`cmd &`) ignores SIGINT, the child would inherit
    # that and never see the signal.
    proc = subprocess.Popen(
        [sys.executable, str(script), str(ckpt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, proc.stderr.read()
        time.sleep(0.5)  # mid-generate
        proc.send_signal(sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # where the front end is stuck, every thread
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
            proc.kill()
            pytest.fail(f"the front end did not exit within 30 s:\n{proc.communicate()[1]}")
        assert _wait_gone(pids) == []
    finally:
        proc.kill()


def test_ranks_keep_stepping_while_the_front_end_does_not_read(ckpt):
    """A rank never waits for the front end: its messages wait in a backlog (here several pipe
    buffers' worth) until the front end reads them, and none is lost."""
    n, max_tokens = 96, 56
    prompts = [[(7 * i + j) % 200 + 1 for j in range(4)] for i in range(n)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(str(ckpt), attention_ranks=1, expert_ranks=1, device="cpu") as llm:
        rids = llm.submit(prompts, params)
        time.sleep(4.0)  # the front end reads nothing meanwhile
        woke = time.time()
        done = {}
        while len(done) < n:
            for out, _ in llm.poll():
                if out.finish_reason is not None:
                    done[out.request_id] = out
    assert sorted(done) == sorted(rids)
    assert all(len(o.token_ids) == max_tokens for o in done.values())
    # every token was sampled before the front end read anything (the ranks did not wait)
    last = max(o.metrics.arrival_time + o.metrics.e2e_latency for o in done.values())
    assert last < woke
