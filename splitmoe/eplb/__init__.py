"""Expert placement and load balancing (EPLB): which slot holds which expert, which replica
serves each (token, expert) pair, how much load each expert saw, and live rebalancing.

* `placement`: `Placement`, the ``slot -> expert`` map of every MoE layer, and its planner.
* `policy`: the replica-choice math in PyTorch (``static``, ``local``, ``global``), the one
  statement of it; the C and Triton kernels (`splitmoe.kernels.balance_cpu`,
  `splitmoe.kernels.balance_triton`) are backends kept bit-identical to it by tests.
* `load`: `LoadStats`, pairs per (layer, expert) over the window and since start.
* `balancer`: `Balancer`, an attention rank's per-step choice, its backend bound once.
* `rebalance`: `ExpertBalance`, one rank's share of it all and the rebalance protocol.

The package depends on `comm`, `config` and `kernels`; `attention_nodes`, `expert_nodes` and
the runtime depend on it, never the other way round. See docs/balancer.md.
"""
