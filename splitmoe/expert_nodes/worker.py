"""The expert rank's step: for every MoE layer, receive tokens, run the experts, send sums back."""

from __future__ import annotations

import torch

from splitmoe.comm.topology import Topology
from splitmoe.comm.transport import Transport
from splitmoe.config import EngineConfig
from splitmoe.expert_nodes.experts import LocalExperts
from splitmoe.scheduler.placement import Placement
from splitmoe.timeline import UNRECORDED_STEPS, Timeline


class ExpertWorker:
    def __init__(
        self,
        topo: Topology,
        cfg: EngineConfig,
        transport: Transport,
        device: torch.device,
        placement: Placement,
    ):
        self.topo = topo
        self.moe_layers = cfg.model.moe_layers
        self.placement = placement
        self.experts = LocalExperts(
            cfg.model,
            placement.experts_on(topo.expert_index),
            cfg.torch_dtype,
            device,
            cfg.backend("moe_backend"),
        )
        self.transport = transport
        self.tokens_served = 0
        self.timeline = Timeline()
        # tokens over shared-memory rings and experts on the native kernels: each (layer,
        # micro-batch) is one native call
        self.native = None
        self.frames = frames = transport.native_frames()
        if frames is not None and self.experts.backend == "cpu" and self.moe_layers:
            from splitmoe.kernels import cpu_native

            self.native = cpu_native.ExpertCall(
                cfg.model.hidden_size,
                cfg.model.top_k,
                cfg.model.moe_intermediate_size,
                frames.rings,
            )
            self.native.set_layers([self.experts.weights[layer] for layer in self.moe_layers])
            self._names: dict[tuple[int, int], tuple[str, str, str]] = {}
            self._done: list[tuple] = []  # this step's calls: (layer, micro-batch, clock, rows)
            self._unrecorded: list[tuple] = []  # steps whose spans and stats `record` owes
            self.timeline.deferred.append(self.record)

    def stats(self) -> dict:
        self.record()  # (the native steps' stats, before the transport's are read)
        return {
            "experts": self.experts.expert_ids,
            "slots": {str(k): v for k, v in self.experts.layer_experts.items()},
            "placement_version": self.placement.version,
            "weights_reloaded": self.experts.weights_reloaded,
            "tokens_served": self.tokens_served,
            "moe_backend": self.experts.backend,
            # (tokens over shared-memory rings, native: a call per layer and micro-batch)
            "native_expert_step": self.native is not None,
        }

    def set_placement(self, placement: Placement) -> None:
        """Rebalance (between steps): loads the weights of the slots whose expert changes."""
        self.experts.update(placement.experts_on(self.topo.expert_index))
        self.placement = placement
        if self.native is not None:
            self.native.set_layers([self.experts.weights[layer] for layer in self.moe_layers])

    def begin(self, micro_batches: int) -> None:
        """The first MoE layer of every micro-batch of a step that the last step began (the
        attention ranks sent it before this step's sync: `runtime`); `step` with ``begun``
        then serves the rest."""
        self._layers(micro_batches, 0, 1)

    def step(self, micro_batches: int = 1, begun: bool = False) -> None:
        """One engine step: the MoE layers in order, each micro-batch in order, as every
        attention rank runs them (``begun``: all but the first layer, which `begin` served). A
        micro-batch's partial sums leave asynchronously, so the next one is received (and the
        attention ranks are unblocked) at once."""
        self._layers(micro_batches, int(begun), len(self.moe_layers))
        with self.timeline.span("flush", "wait"):
            self.transport.flush()
        if self.native is not None:
            self._unrecorded.append((self.timeline.step, self._done))
            self._done = []
            if len(self._unrecorded) >= UNRECORDED_STEPS:
                self.record()

    def _layers(self, micro_batches: int, first: int, end: int) -> None:
        """MoE layers ``first .. end - 1`` (indices into ``moe_layers``) of every micro-batch."""
        if self.native is not None:
            return self._native_layers(micro_batches, first, end)
        tl = self.timeline
        for layer in self.moe_layers[first:end]:
            for j in range(micro_batches):
                with tl.span(f"receive L{layer}.{j}", "wait"):
                    batch = self.transport.receive(layer=layer)
                with tl.span(f"experts L{layer}.{j}", "compute"):
                    y = self.experts.compute_batch(layer, batch)
                with tl.span(f"send L{layer}.{j}", "comm"):
                    self.transport.send_back(y, batch)
                self.tokens_served += batch.rows.shape[0]

    def _native_layers(self, micro_batches: int, first: int, end: int) -> None:
        """`_layers` with each (layer, micro-batch) in one native call (`cpu_native.ExpertCall`):
        the same frames and partial sums. A frame not here within the call's spin, or without
        room on its ring, goes through the lane's wait; the calls' clock readings and row counts
        are kept for `record`."""
        call, frames = self.native, self.frames
        for i in range(first, end):
            for j in range(micro_batches):
                rc = call.layer(i)
                while rc in (1, 3):
                    if rc == 3:
                        call.grow(call.need)
                    else:
                        self._receive(call.wait_rank)
                    rc = call.layer(i)
                if rc == 2:  # partial sums without room on their rings now
                    for a, start, size in call.unsent():
                        frames.send(a, call.y, start, size)
                self._done.append(
                    (self.moe_layers[i], j, call.stamps_np.copy(), call.counts.copy())
                )
                self.tokens_served += call.N

    def record(self) -> None:
        """The native calls of the steps served since the last call as the timeline's spans
        and the transport's stats (the per-op path's records). Here in bulk, not after each
        step: on the rank that sets an overlapped pipeline's pace, ~30-50 us a step (as
        `RemoteDecodeStep.record` on the attention side)."""
        if self.native is None:
            return
        spans, row_bytes = self.timeline.spans, 4 * self.native.hidden
        for step, done in self._unrecorded:
            seconds: dict[int, float] = {}
            counts: dict[int, list] = {}
            for layer, j, t, per_rank in done:
                names = self._names.get((layer, j))
                if names is None:
                    names = self._names[layer, j] = tuple(
                        f"{what} L{layer}.{j}" for what in ("receive", "experts", "send")
                    )
                t = (t * 1e-9).tolist()
                spans.append((step, names[0], "wait", t[0], t[1]))
                spans.append((step, names[1], "compute", t[1], t[2]))
                spans.append((step, names[2], "comm", t[2], t[3]))
                seconds[layer] = seconds.get(layer, 0.0) + t[1] - t[0] + t[3] - t[2]
                counts.setdefault(layer, []).append(per_rank.tolist())
            for layer, per_rank in counts.items():
                self.transport.account_native(layer, per_rank, row_bytes, seconds[layer])
        self._unrecorded.clear()

    def _receive(self, a: int) -> None:
        """Attention rank a's frame of this call through the lane's wait, into the call's
        rows after those already received."""
        call, frames = self.native, self.frames
        size, rb = frames.recv_header(a), call.rows.shape[1]
        if size % rb:
            raise RuntimeError(
                f"rank {self.topo.rank}: attention rank {a} sent {size} bytes, not whole rows of "
                f"{rb}: the ranks' collective calls diverged"
            )
        at = call.receive_at(a)
        if at + size > call.rows.numel():
            call.grow((at + size) // rb)
        frames.recv_bytes(a, call.rows, at, size)
        call.got(a, size // rb)
