"""The expert rank's step: for every MoE layer and micro-batch, receive tokens, run the experts,
send the weighted sums back."""

from __future__ import annotations

import torch

from splitmoe.comm.topology import Topology
from splitmoe.comm.transport import Transport
from splitmoe.config import EngineConfig
from splitmoe.cuda_graphs import graph_stats
from splitmoe.eplb.placement import Placement
from splitmoe.expert_nodes.experts import LocalExperts, StagedExperts
from splitmoe.kernels.backends import moe_backend
from splitmoe.timeline import Timeline


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
            moe_backend(cfg.moe_backend, device),
        )
        self.cfg = cfg
        self._capture_graphs()
        self.transport = transport
        self.tokens_served = 0
        self.timeline = Timeline()

    def _capture_graphs(self) -> None:
        """CUDA graphs of every layer's experts, captured now (a no-op on CPU): a call holds at
        most one row per token of every attention rank's decode batch."""
        cfg = self.cfg
        self.experts.capture_graphs(
            cfg.cuda_graphs, cfg.scheduler.max_num_seqs * self.topo.num_attention, cfg.model.top_k
        )

    def stats(self) -> dict:
        return {
            "experts": self.experts.expert_ids,
            "slots": {str(k): v for k, v in self.experts.layer_experts.items()},
            "placement_version": self.placement.version,
            "weights_reloaded": self.experts.weights_reloaded,
            "tokens_served": self.tokens_served,
            "moe_backend": self.experts.backend.name,
            "weight_bytes": self.experts.weight_bytes,
            # expert calls (layer, micro-batch) replayed from CUDA graphs, and the row counts
            # captured ([]: eager)
            **graph_stats(self.experts.graphs),
        }

    def stage(self, placement: Placement) -> StagedExperts:
        """Rebalance, first half: starts reading the weights of this rank's slots whose expert
        changes in ``placement``, in the background (`LocalExperts.stage`)."""
        return self.experts.stage(placement.experts_on(self.topo.expert_index))

    def switch_layer(self, staged: StagedExperts, layer: int, placement: Placement) -> None:
        """Rebalance, second half, between two steps: ``layer`` serves its slots' new experts;
        ``placement``: the placement in use from now on."""
        self.experts.apply(staged, layer)
        self.placement = placement

    def rebind(self, topo: Topology, transport: Transport, balance) -> int:
        """After the job lost ranks (fault tolerance): its place in the rebuilt world, and the
        placement of ``balance``; see `adopt`."""
        return self.adopt(topo, transport, balance.placement)

    def adopt(self, topo: Topology, transport: Transport, placement: Placement) -> int:
        """After an expert rank was lost (fault tolerance): this rank's place in the rebuilt
        world, its new transport, and ``placement`` (`Placement.without`), whose changed slots
        it reads from the checkpoint now, before the interrupted step is replayed; returns how
        many (layer, slot) weights it read. A survivor whose slots grew (no replica slot held
        a lost expert) captures its CUDA graphs again: the grown layers' tensors are new."""
        self.topo, self.transport = topo, transport
        before = {layer: len(ids) for layer, ids in self.experts.layer_experts.items()}
        staged = self.experts.stage(placement.experts_on(topo.expert_index))
        read = sum(self.experts.apply(staged, layer) for layer in self.moe_layers)
        self.placement = placement
        if any(len(self.experts.layer_experts[layer]) != n for layer, n in before.items()):
            self._capture_graphs()
        return read

    def step(self, micro_batches: int = 1) -> None:
        """One engine step: the MoE layers in order, each micro-batch in order, as every
        attention rank runs them. The receive of the next micro-batch is posted before this one
        computes, so its tokens arrive meanwhile (over a communication thread; over shared
        memory they wait in the ring), and a micro-batch's partial sums leave asynchronously,
        so the attention ranks are unblocked at once. Time blocked on data is "wait"."""
        tl = self.timeline
        order = [(layer, j) for layer in self.moe_layers for j in range(micro_batches)]
        batch = self.transport.receive(layer=order[0][0]) if order else None
        for k, (layer, j) in enumerate(order):
            nxt = self.transport.receive(layer=order[k + 1][0]) if k + 1 < len(order) else None
            with tl.span(f"receive L{layer}.{j}", "wait"):
                batch.wait()
            with tl.span(f"experts L{layer}.{j}", "compute"):
                y = self.experts.compute_batch(layer, batch)
            with tl.span(f"send L{layer}.{j}", "comm"):
                self.transport.send_back(y, batch)
            self.tokens_served += batch.rows.shape[0]
            batch = nxt
        with tl.span("flush", "wait"):
            self.transport.flush()
