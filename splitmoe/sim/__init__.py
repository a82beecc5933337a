"""Cluster simulator: predicts what a deployment of a model on given hardware will do.

`ModelShape` (from any supported ``config.json``, or DeepSeek-V2/V3), a `HardwareProfile`
(roofline, host overheads, the transport's link cost model; ``profiles/{h100,h200,cpu}.json``),
a `Deployment` (attention:expert ranks, micro-batches, transport, balancer, replicas) and a
workload go into `Simulator`, which returns per-layer attention, expert and communication times,
the ping-pong overlap, TPOT and throughput per GPU. `calibrate` measures this machine's profile;
`validate` checks predictions against the scaling study's runs; `planner` searches deployments
under a TPOT target (``scripts/plan.py``).
"""

from splitmoe.sim.hardware import HardwareProfile, Overheads, load_profile
from splitmoe.sim.model import ModelShape
from splitmoe.sim.simulator import Deployment, Simulator

__all__ = ["Deployment", "HardwareProfile", "ModelShape", "Overheads", "Simulator", "load_profile"]
