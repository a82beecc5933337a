"""The ranks' pipes to the front end (`splitmoe.llm._Outbox` / `_Inboxes`): a rank never blocks on
a front end that reads late, and every message arrives once, in order."""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time

import pytest

import splitmoe.llm as llm_module
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


def _bell_pipes():
    reader, writer = mp.Pipe(duplex=False)
    bell_reader, bell = mp.Pipe(duplex=False)
    return _Outbox(writer, bell), _Inboxes([reader], bell_reader)


def _put_later(out: _Outbox, msgs: list, ring: bool, delay_s: float = 0.05) -> threading.Thread:
    def put():
        time.sleep(delay_s)
        for msg in msgs:
            out.put(msg, ring=ring)

    t = threading.Thread(target=put, daemon=True)
    t.start()
    return t


def test_a_front_end_waiting_on_the_bell_wakes_for_ringing_messages_only(monkeypatch):
    # `generate` waits on the bell: a step without a finished request wakes nobody, yet it is
    # read (in order, before what follows) once the front end wakes
    monkeypatch.setattr(llm_module, "_QUIET_TICK_S", 5.0)
    out, inbox = _bell_pipes()
    quiet = _messages(0, 3)
    _put_later(out, quiet, ring=False).join()
    t = time.monotonic()
    assert inbox.get(1.0, every_message=False) == quiet[0]  # read only when its wait ended
    assert time.monotonic() - t >= 0.95
    assert [inbox.get(0, every_message=False) for _ in range(2)] == quiet[1:]

    quiet, loud = _messages(0, 2), ("step", 0, "finished")
    _put_later(out, quiet, ring=False).join()
    t = time.monotonic()
    putter = _put_later(out, [loud], ring=True)
    got = [inbox.get(4.0, every_message=False) for _ in range(3)]
    putter.join()
    assert got == [*quiet, loud]
    assert time.monotonic() - t < 3.0  # the ring woke it, not the 4 s timeout or the tick

    # a front end that wants every message (`poll`, `stream`) wakes for each one
    t = time.monotonic()
    putter = _put_later(out, quiet, ring=False)
    assert inbox.get(4.0) == quiet[0]
    assert time.monotonic() - t < 3.0
    putter.join()  # (an outbox has one writer: the rank's main thread)
    out.close()
    inbox.close()


def test_a_full_pipe_rings_the_bell(monkeypatch):
    # steps that never ring still reach a front end waiting on the bell once the pipe fills:
    # the rank rings so that the front end drains it, and no message is lost or reordered
    monkeypatch.setattr(llm_module, "_QUIET_TICK_S", 5.0)
    out, inbox = _bell_pipes()
    sent = _messages(0, 60)  # ~600 KB: more than a pipe holds
    for msg in sent:
        out.put(msg, ring=False)
    assert out.pending
    got, waits = [], []
    while out.pending:
        out.flush()  # (what a rank's loop does every iteration)
        t = time.monotonic()
        got.append(inbox.get(4.0, every_message=False))
        waits.append(time.monotonic() - t)
    assert max(waits) < 3.0  # woken by the bell each time, not at the end of its 4 s wait
    while len(got) < len(sent):  # the rest fits the pipe: read when the front end wakes
        got.append(inbox.get(0.1, every_message=False))
    assert got == sent
    out.close()
    inbox.close()


def test_wake_ends_a_wait_at_once():
    """`LLM.wake` (a server's engine thread has requests to submit) ends a `get` that waits."""
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    inbox = _Inboxes([reader])
    for every in (True, False):
        threading.Timer(0.05, inbox.wake).start()
        t0 = time.monotonic()
        with pytest.raises(queue.Empty):
            inbox.get(5.0, every_message=every)
        assert time.monotonic() - t0 < 2.0
    writer.close()
    inbox.close()
