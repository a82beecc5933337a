"""The ranks' pipes to the front end (`splitmoe.llm._Outbox` / `_Inboxes`): a rank never blocks on
a front end that reads late, and every message arrives once, in order."""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time

import pytest

from splitmoe.llm import _Inboxes, _Outbox


def _messages(rank: int, n: int) -> list:
    # sizes from a few bytes to ~20 KB, so frames straddle the reader's chunks and the pipe
    return [("step", rank, i, b"x" * (i * 997 % 20011)) for i in range(n)]


def test_puts_never_block_and_every_message_arrives_in_order():
    pipes = [mp.Pipe(duplex=False) for _ in range(2)]
    outs = [_Outbox(w) for _, w in pipes]
    sent = {r: _messages(r, 200) for r in range(2)}  # ~2 MB each: far more than a pipe holds

    def put_all():
        for r, out in enumerate(outs):
            for msg in sent[r]:
                out.put(msg)

    putter = threading.Thread(target=put_all, daemon=True)
    putter.start()
    putter.join(10)
    assert not putter.is_alive(), "a put waited for the reader"
    assert all(out.pending for out in outs)
    inbox = _Inboxes([r for r, _ in pipes])
    got = {0: [], 1: []}
    while any(out.pending for out in outs) or len(got[0]) + len(got[1]) < 400:
        for out in outs:
            out.flush()  # (what a rank's loop does every iteration)
        try:
            msg = inbox.get(0.05)
        except queue.Empty:
            continue
        got[msg[1]].append(msg)
    assert got == sent
    for out in outs:
        out.close()
    inbox.close()


def test_get_waits_for_its_timeout_then_empty():
    reader, writer = mp.Pipe(duplex=False)
    out, inbox = _Outbox(writer), _Inboxes([reader])
    t = time.monotonic()
    with pytest.raises(queue.Empty):
        inbox.get(0.2)
    assert 0.19 <= time.monotonic() - t < 2
    out.put(("ready", 0, "attention"))
    assert inbox.get(1.0) == ("ready", 0, "attention")
    out.close()  # the rank exits: its end closes, and the front end stops watching it
    with pytest.raises(queue.Empty):
        inbox.get(0.1)
    inbox.close()
