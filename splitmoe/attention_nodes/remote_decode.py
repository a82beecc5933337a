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
from splitmoe.kernels.cpu_native import DecodeInputs, RemoteBatch
from splitmoe.scheduler.balancer import Balancer
from splitmoe.timeline import UNRECORDED_STEPS, Timeline


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
        self._begun: list | None = None  # the next step's batches, layer 0 dispatched
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

    def run(
        self,
        mbs: Sequence[DecodeInputs] | None,
        on_logits: Callable[[int, torch.Tensor], None],
        begin: Callable[[int, torch.Tensor], DecodeInputs] | None = None,
    ) -> None:
        """The step of micro-batches ``mbs`` of one-token sequences, layer by layer and
        micro-batch by micro-batch as `AttentionModel.forward` runs them (micro-batch j read when
        layer 0 reaches it); ``on_logits(j, logits [T_j, V])`` as soon as micro-batch j's are
        final (valid until the next step).

        With ``begin``, each micro-batch begins the next step's: ``begin(j, logits)`` gives the
        next step's micro-batch j, whose layer 0 runs and is dispatched before ``on_logits(j,
        logits)``; after the last one, layer 1 of each (where there is a layer 1 before the
        logits). The expert ranks serve them right after this step's last micro-batches, and
        the next call, with ``mbs`` None, goes on from there."""
        L = self.num_layers
        if mbs is None:  # the step the last call began
            if self._begun is None:
                raise RuntimeError("remote decode: no step was begun to go on with")
            batches, self._begun = self._begun, None
            n = len(batches)
            order = [(i, j) for i in range(1 + int(L > 1), L + 1) for j in range(n)]
        else:
            maps = [self.balancer.static_map(i) for i in range(L)]
            if self._maps is None or any(
                a[0] is not b[0] or a[1] is not b[1] for a, b in zip(maps, self._maps)
            ):  # (a new placement: new expert -> slot maps)
                self.native.set_maps(maps)
                self._maps = maps
            batches, n = [], len(mbs)
            order = [(i, j) for i in range(L + 1) for j in range(n)]
        stamps, counts, begun = [], [], []
        for i, j in order:
            if i == 0:
                batches.append(self._start(j, mbs[j]))
            b = batches[j]
            self._layer(b, i)
            if i == L:
                # (kept before the next step's micro-batch j may take these buffers)
                stamps.append(b.stamps_np.copy())
                counts.append(b.counts_np.copy())
                if begin is None:
                    on_logits(j, b.logits)
                    continue
                begun.append(self._start(j, begin(j, b.logits)))
                self._layer(begun[j], 0)  # (layer 0 does not touch the logits)
                if j < n - 1 or L == 1:
                    on_logits(j, b.logits)
                    continue
                # then layer 1 of each: the experts have served the first ones' layer 0 by
                # now, and they serve these while this rank emits, schedules and syncs
                self._layer(begun[0], 1)
                on_logits(j, b.logits)
                for k in range(1, n):
                    self._layer(begun[k], 1)
        if begin is not None:
            self._begun = begun
        # The step's clock readings and row counts, kept for `record`: turned into spans and
        # stats here they cost the attention rank ~50-70 us between steps (cold interpreter
        # work right after the native calls, ~18 us when timed in a loop), on the path that
        # bounds the pipeline; in bulk, later, a few us a step.
        self._unrecorded.append((self.timeline.step, stamps, counts, batches[0].rows.shape[1]))
        if len(self._unrecorded) >= UNRECORDED_STEPS:
            self.record()

    def _start(self, j: int, inputs: DecodeInputs) -> RemoteBatch:
        """Micro-batch j's native batch, started on ``inputs`` (with the RoPE table they need)."""
        top = int(inputs.positions.max()) if len(inputs) else 0
        cos, sin = self.model.rope_table(top, torch.float32)
        return self.native.batch(j, inputs, cos, sin)

    def _layer(self, b: RemoteBatch, i: int) -> None:
        """Layer i of batch b (i = L: the logits): the native call, and the lane's wait or send
        where it hands them over."""
        rc = b.layer(i)
        while rc == 1:  # a frame of partial sums not here yet: the lane's wait
            r = b.wait_rank
            self.frames.recv(r, b.partial, *b.pending_frame(i - 1, r))
            b.got(r)
            rc = b.layer(i)
        if rc == 2:  # frames without room on their rings now: the lane's send
            for r, start, size in b.unsent(i):
                self.frames.send(r, b.rows, start, size)

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
