"""The loop every rank runs, whoever started it (an `EngineClient`, torchrun or mpirun).

One iteration of `RankLoop.step` reads as its phases:

1. ``take``: the channel's new requests, aborts and queries (none while a step is replayed);
2. ``answer``: stats and trace queries, at once;
3. ``plan``: an attention rank admits and aborts requests and plans its step; the `StepRow`
   it will tell the others;
4. ``exchange``: every rank's row, all-gathered (`StepSync`): whether the job ends, whether a
   step runs, the rebalance and publication every rank then does alike;
5. ``publish`` and ``rebalance``, decided by the exchange;
6. ``run``: the step, if any rank has tokens (attention ranks with none still join each
   dispatch and combine; expert ranks serve every MoE layer);
7. ``emit``: the step's tokens to the channel.

A failure inside the exchange or the step is a lost peer or not (`recovery.survivable`): with
fault tolerance the survivors rebuild the job (`recovery.recover`) and replay the interrupted
iteration with the same row; otherwise it ends the rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from splitmoe.comm.control import StepDecision, StepRow
from splitmoe.engine.channel import Channel, Inbox
from splitmoe.engine.rank import RankParts, rank_counters, rank_stats
from splitmoe.engine.recovery import recover, survivable
from splitmoe.scheduler.micro_batches import MicroBatchChooser

# How long an idle attention rank blocks on its channel before the next sync: the heartbeat that
# keeps the idle expert ranks' collective timeouts from firing. The front end wakes every
# attention rank as soon as it has work for any of them (and for queries and closing), so this
# bounds only how often an idle job wakes up: a poll of a few milliseconds would cost an idle
# `LLM`'s host hundreds of process wake-ups a second and slow whatever else runs there.
IDLE_POLL_S = 0.1

# A rank publishes its counters (`rank_counters`) on its own, the front end keeps the latest
# (`LLM.latest_stats`) and GET /metrics reads that, asking no rank. While anything changes they
# go out at most every STATS_PUBLISH_S; a request arriving or aborted, or the job going idle,
# is told after STATS_EVENT_S at most (so a scrape soon after sees it), which bounds a rank's
# cost to STATS_EVENT_S's rate however often requests come. An idle job publishes nothing.
STATS_PUBLISH_S = 1.0
STATS_EVENT_S = 0.02

# An attention rank whose only work is KV still arriving from a prefill instance checks for it
# this often (and meanwhile for new requests) instead of spinning through empty steps.
PULL_POLL_S = 0.002


@dataclass
class Publication:
    """When this rank's counters are due to go out (see `STATS_PUBLISH_S`)."""

    last: float = -float("inf")  # time.monotonic() of the last publication
    changed: bool = True  # since then (a new rank has not published yet)
    urgent: bool = True  # a change a scrape should see soon

    def note(self, changed: bool, urgent: bool = False) -> None:
        self.changed |= changed or urgent
        self.urgent |= urgent

    def due(self, now: float) -> bool:
        wait = STATS_EVENT_S if self.urgent else STATS_PUBLISH_S
        return self.changed and now - self.last >= wait

    def sent(self, now: float) -> None:
        self.last, self.changed, self.urgent = now, False, False


@dataclass
class Rebalancing:
    """This rank's part in rebalances its channel asked for: ``asked`` (queries to tell the
    others of at the next exchange) and ``answering`` (the queries of the rebalance in
    progress, answered when it is in use everywhere)."""

    asked: list[int]
    answering: list[int]


class RankLoop:
    def __init__(self, me: RankParts, channel: Channel, shared_gpu: bool = False):
        self.me = me
        self.channel = channel
        self.chooser = MicroBatchChooser(me.cfg.parallel, shared_gpu)
        self.publication = Publication() if channel.publishes else None
        self.rebalancing = Rebalancing([], [])
        self.busy = False  # the last exchange ran a step (the next one is due at once)
        self.times = None  # this rank's times in its last step, told at the next exchange
        self.replay: StepRow | None = None  # (fault tolerance) the row of an interrupted step
        self.updates = self.record = None

    def run(self) -> None:
        while self.step():
            pass

    def step(self) -> bool:
        """One iteration; False once every rank has left the job."""
        inbox = self.take()
        self.answer(inbox)
        row = self.plan(inbox)
        try:
            decision = self.exchange(row)
            if decision.finished:
                return False
            self.publish(decision)
            self.rebalance(decision)
            self.busy = decision.run
            self.replay = None
            if decision.run:
                self.run_step(decision)
        except Exception as error:
            if not survivable(self.me, error):
                raise
            recover(self.me, error, self.channel)
            # Replayed: the exchange (and the step) this failure interrupted. An attention
            # rank's planned batch still stands: a step commits its tokens only at its end
            # (one micro-batch under fault tolerance), and the replay writes the same KV again.
            self.replay, self.times = row, None
            self.rebalancing.answering = []
            return True
        self.emit(decision)
        return True

    # ---- the phases ------------------------------------------------------------------------

    def take(self) -> Inbox:
        """New requests and queries; none while a step is replayed (its plan stands)."""
        if self.replay is not None:
            return Inbox()
        worker = self.me.worker
        wait = 0.0
        if self.me.topo.is_attention and not self.busy:  # (else a step is due at once)
            if not worker.has_work:
                wait = IDLE_POLL_S
            elif worker.only_transfers:
                wait = PULL_POLL_S
        return self.channel.poll(wait)

    def answer(self, inbox: Inbox) -> None:
        me = self.me
        for query in inbox.stats:
            stats = rank_stats(
                me.topo, me.worker, me.transport, me.balance, self.chooser, me.origin
            )
            self.channel.answer_stats(query, me.with_members(stats))
        for query in inbox.traces:
            self.channel.answer_trace(query, me.topo.role, me.worker.timeline.export())
        self.rebalancing.asked += inbox.rebalances

    def plan(self, inbox: Inbox) -> StepRow:
        """This rank's row for the exchange (an attention rank admits, aborts and plans)."""
        if self.replay is not None:
            return self.replay
        me = self.me
        tokens, done, freed = 0, True, False
        if me.topo.is_attention:
            worker = me.worker
            with worker.timeline.span("schedule", "compute"):
                refused = [u for spec in inbox.requests if (u := worker.add_request(spec))]
                if refused:  # (requests whose admission raised: they fail alone)
                    self.channel.emit(refused, None)
                if inbox.aborts:
                    self.channel.emit(worker.abort(inbox.aborts), None)
                released = worker.kv_releases
                tokens = worker.plan()
                freed = worker.kv_releases != released  # (blocks came back: counters changed)
            done = self.channel.closed and not worker.has_work
        publish = False
        if self.publication is not None:
            self.publication.note(False, urgent=bool(inbox.requests or inbox.aborts or freed))
            publish = self.publication.due(time.monotonic())
        return StepRow(
            tokens,
            done,
            rebalance=bool(self.rebalancing.asked),
            ready=me.balance is None or me.balance.ready,
            publish=publish,
            times=self.times,
        )

    def exchange(self, row: StepRow) -> StepDecision:
        with self.me.worker.timeline.span("sync", "wait"):
            decision = self.me.sync.exchange(row)
        if not decision.finished:
            self.chooser.observe(decision.times)
            self.times = None
        return decision

    def publish(self, decision: StepDecision) -> None:
        pub = self.publication
        if pub is None:
            return
        me = self.me
        if decision.publish:  # (some rank's are due: all go out together)
            counters = rank_counters(me.topo, me.worker, me.origin)
            counters["published_at"] = time.time()
            self.channel.publish(me.with_members(counters))
            pub.sent(time.monotonic())
        # (the step about to run changes them; the job going idle, urgently)
        pub.note(decision.run, urgent=self.busy and not decision.run)

    def rebalance(self, decision: StepDecision) -> None:
        """Starts, advances and answers expert rebalances, as every rank decides alike."""
        balance, rb = self.me.balance, self.rebalancing
        if balance is None:  # colocated: nothing to move; asks are answered at once
            for query in rb.asked:
                self.channel.rebalanced(query, {})
            rb.asked = []
            return
        if balance.in_transition and decision.ready:
            with self.me.worker.timeline.span("rebalance", "compute"):
                if balance.advance(self.me.worker):
                    for query in rb.answering:
                        self.channel.rebalanced(query, balance.stats())
                    rb.answering = []
        if decision.rebalance and not balance.in_transition:  # else: after this one
            balance.begin()
            rb.answering, rb.asked = rb.asked, []

    def run_step(self, decision: StepDecision) -> None:
        me = self.me
        worker = me.worker
        worker.timeline.step += 1
        m = self.chooser.choose(decision.tokens[: me.topo.num_attention])
        worker.timeline.take_times()  # (this step's times start here)
        if me.topo.is_attention:
            self.updates, self.record = worker.execute(m)
        else:
            worker.step(m)

    def emit(self, decision: StepDecision) -> None:
        if not decision.run:
            return
        me = self.me
        self.times = me.worker.timeline.take_times()
        if me.topo.is_attention and self.record is not None:
            with me.worker.timeline.span("emit", "comm"):
                self.channel.emit(self.updates, self.record)
        self.updates = self.record = None
        balance = me.balance
        if balance is not None and balance.due() and not balance.in_transition:
            balance.begin()
