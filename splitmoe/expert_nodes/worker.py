"""The expert rank's step: for every MoE layer, receive tokens, run the experts, send sums back."""

from __future__ import annotations

import torch

from splitmoe.comm.topology import Topology
from splitmoe.comm.transport import Transport
from splitmoe.config import EngineConfig
from splitmoe.expert_nodes.experts import LocalExperts


class ExpertWorker:
    def __init__(
        self, topo: Topology, cfg: EngineConfig, transport: Transport, device: torch.device
    ):
        self.topo = topo
        self.moe_layers = cfg.model.moe_layers
        self.experts = LocalExperts(
            cfg.model,
            topo.experts_of(topo.expert_index),
            cfg.torch_dtype,
            device,
            cfg.backend("moe_backend"),
        )
        self.transport = transport
        self.tokens_served = 0

    def stats(self) -> dict:
        return {"experts": self.experts.expert_ids, "tokens_served": self.tokens_served}

    def step(self) -> None:
        """One engine step: the MoE layers in order, as every attention rank runs them."""
        for layer in self.moe_layers:
            batch = self.transport.receive(layer=layer)
            y = self.experts.compute(layer, batch.x, batch.expert_ids, batch.weights)
            self.transport.send_back(y, batch)
            self.tokens_served += batch.x.shape[0]
