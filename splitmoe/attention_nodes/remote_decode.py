"""A decode step on an attention rank whose experts live on expert ranks of this host, with
each (layer, micro-batch) of the ping-pong in one native call (`cpu_native.RemoteDecode`).

`AttentionModel.forward` with `RemoteExperts` runs the same kernels and sends the same frames,
but at decode batch sizes the Python between them (the forward loop, the decode layer's
wrapper, the dispatch's routing and bookkeeping, the combine's frames and sums: ~40 us a layer
and micro-batch on the 2-core CPU host) costs about as much as the kernels. With two
micro-batches the attention rank is the one that sets the pace, so that Python was the
pipeline's bound. Here the loop only calls the native layer and, where a frame has not arrived
within the native spin or does not fit its ring, waits for it through the lane (which keeps the
shared-memory rules: the progress rule, futex sleeps, the peer's liveness, the timeout). The
stats and the timeline get the same records, from the calls' clock readings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from splitmoe.attention_nodes.kv_cache import PagedKVCache
from splitmoe.attention_nodes.model import AttentionModel
from splitmoe.comm.transport import NativeFrames, Transport
from splitmoe.kernels.cpu_native import DecodeInputs
from splitmoe.scheduler.balancer import Balancer
from splitmoe.timeline import Timeline

# Steps whose spans and stats may wait for `RemoteDecodeStep.record` (or the next read).
UNRECORDED_STEPS = 64


class RemoteDecodeStep:
    """Decode steps of `AttentionModel` with its experts behind the flat transport's
    shared-memory rings, under the static balancer. `build` returns None where that does not
    hold: a dense layer or a shared expert, no native kernels, a transport or balancer that
    routes any other way."""

    def __init__(
        self,
        model: AttentionModel,
        kv_cache: PagedKVCache,
        transport: Transport,
        balancer: Balancer,
        timeline: Timeline,
        frames: NativeFrames,
    ):
        from splitmoe.kernels import cpu_native

        self.model = model
        self.transport = transport
        self.balancer = balancer
        self.timeline = timeline
        self.frames = frames
        self.num_layers = L = len(model.layers)
        self.native = cpu_native.RemoteDecode(
            model.decode_layers,
            model.embed,
            model.final_norm,
            model.lm_head,
            kv_cache.pool,
            model.scale,
            transport.slot_rank,
            transport.slot_local,
            frames.rings,
        )
        self._names = [(f"dispatch L{i}", f"combine L{i}") for i in range(L)]
        self._maps: list | None = None
        self._unrecorded: list[tuple] = []  # steps whose spans and stats `record` still owes
        timeline.deferred.append(self.record)

    @classmethod
    def build(
        cls,
        model: AttentionModel,
        kv_cache: PagedKVCache,
        transport: Transport,
        balancer: Balancer,
        timeline: Timeline,
    ) -> RemoteDecodeStep | None:
        frames = transport.native_frames()
        fits = (
            frames is not None
            and model.decode_layers is not None
            and all(w.router is not None and w.mlp_gate_up is None for w in model.layers)
            and model.cfg.top_k <= model.native.MAX_TOP_K
            and all(balancer.static_map(i) is not None for i in range(len(model.layers)))
        )
        return cls(model, kv_cache, transport, balancer, timeline, frames) if fits else None

    def run(self, mbs: Sequence[DecodeInputs], on_logits: Callable[[int, torch.Tensor], None]):
        """The step of micro-batches ``mbs`` of one-token sequences, layer by layer and
        micro-batch by micro-batch as `AttentionModel.forward` runs them (micro-batch j read when
        layer 0 reaches it); ``on_logits(j, logits [T_j, V])`` as soon as micro-batch j's are
        final (valid until the next step)."""
        maps = [self.balancer.static_map(i) for i in range(self.num_layers)]
        if self._maps is None or any(
            a[0] is not b[0] or a[1] is not b[1] for a, b in zip(maps, self._maps)
        ):  # (a new placement: new expert -> slot maps)
            self.native.set_maps(maps)
            self._maps = maps
        L, frames = self.num_layers, self.frames
        batches = []
        for i in range(L + 1):
            for j in range(len(mbs)):
                if i == 0:
                    inputs = mbs[j]
                    top = int(inputs.positions.max()) if len(inputs) else 0
                    cos, sin = self.model.rope_table(top, torch.float32)
                    batches.append(self.native.batch(j, inputs, cos, sin))
                b = batches[j]
                rc = b.layer(i)
                while rc == 1:  # a frame of partial sums not here yet: the lane's wait
                    r = b.wait_rank
                    frames.recv(r, b.partial, *b.pending_frame(i - 1, r))
                    b.got(r)
                    rc = b.layer(i)
                if rc == 2:  # frames without room on their rings now: the lane's send
                    for r, start, size in b.unsent(i):
                        frames.send(r, b.rows, start, size)
                if i == L:
                    on_logits(j, b.logits)
        # The step's clock readings and row counts, kept for `record`: turned into spans and
        # stats here they cost the attention rank ~50-70 us between steps (cold interpreter
        # work right after the native calls, ~18 us when timed in a loop), on the path that
        # bounds the pipeline; in bulk, later, a few us a step.
        self._unrecorded.append(
            (
                self.timeline.step,
                [b.stamps_np.copy() for b in batches],
                [b.counts_np.copy() for b in batches],
                batches[0].rows.shape[1],
            )
        )
        if len(self._unrecorded) >= UNRECORDED_STEPS:
            self.record()

    def record(self) -> None:
        """Records the dispatch and combine spans and the transport's stats of the steps run
        since the last call (`Timeline.export` calls it, and so does `AttentionWorker.stats`
        before the transport's stats are read)."""
        spans, account = self.timeline.spans, self.transport.account_native
        for step, stamps, counts, row_bytes in self._unrecorded:
            seconds = [0.0] * self.num_layers
            for t in stamps:
                s = (t * 1e-9).tolist()  # [L + 1, 4] seconds
                for i, (dispatch, combine) in enumerate(self._names):
                    begin, end = s[i], s[i + 1]
                    spans.append((step, dispatch, "comm", begin[2], begin[3]))
                    spans.append((step, combine, "wait", end[0], end[1]))
                    seconds[i] += begin[3] - begin[2] + end[1] - end[0]
            per_batch = [c.tolist() for c in counts]  # [m][L][R]
            for i, layer_seconds in enumerate(seconds):
                account(i, [c[i] for c in per_batch], row_bytes, layer_seconds)
        self._unrecorded.clear()
