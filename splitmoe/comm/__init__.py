"""Communication between ranks.

`Topology` says who is who (roles, nodes); `transport` moves tokens from attention ranks to expert
ranks and partial sums back (dispatch / combine); `transports` names the schemes (``TRANSPORTS``):
``"flat"`` (one all-to-all per direction, the baseline and oracle), ``"two_phase"`` (aggregate a
node's rows on proxy ranks over the intra-node link, then one message per destination across
nodes; `two_phase`) and ``"auto"`` (per layer, whichever `cost_model` predicts faster, decided
from counts every rank shares). Every transport counts its messages, bytes and time per layer and
link class (`Transport.stats_snapshot`). `control` is the small per-step all-gather that keeps all
ranks in lockstep; `distributed` sets up the process groups.
"""
