"""The experts of an attention rank whose experts are elsewhere: each (token, expert)'s replica
chosen by the balancer, tokens dispatched by slot to the expert ranks, partial sums combined."""

from __future__ import annotations

from splitmoe.comm.transport import Transport
from splitmoe.eplb.balancer import Balancer
from splitmoe.timeline import Timeline


class RemoteExperts:
    """ExpertExecutor over a transport: `start` picks the replica of each (token, expert) with
    the balancer and dispatches by slot to the expert ranks, `finish` combines their partial
    sums."""

    def __init__(self, transport: Transport, timeline: Timeline, balancer: Balancer):
        self.transport = transport
        self.timeline = timeline
        self.balancer = balancer

    def start(self, layer, x, topk_ids, topk_weights):
        with self.timeline.span(f"balance L{layer}", "compute"):
            slots = self.balancer.choose(layer, topk_ids)  # [T, k]
        with self.timeline.span(f"dispatch L{layer}", "comm"):
            return self.transport.dispatch(x, slots, topk_weights, layer=layer)

    def finish(self, handle):
        with self.timeline.span(f"combine L{handle.layer}", "wait"):
            return self.transport.combine(handle)
