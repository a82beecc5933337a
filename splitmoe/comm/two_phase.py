"""Two-phase attention <-> expert exchange (aggregate inside a node, then one message per
destination across nodes), and the adaptive choice between it and the flat one per layer.

With ``A`` attention and ``E`` expert ranks, the flat exchange sends up to ``A x E`` small
messages per layer; each one that crosses nodes pays the network's per-message latency. The
two-phase exchange first regroups, over the node's fast link, every row of the node's attention
ranks by destination onto one **proxy** attention rank of the node, which then sends one message
per destination expert rank:

* proxies: for node ``n`` with attention ranks ``S_n`` (``m`` of them) and the expert ranks *on
  other nodes* sorted ``d_0 < d_1 < ...``, ``d_i`` is proxied by ``S_n[i % m]``. With full nodes of
  ``g`` ranks this is rail-aligned: the proxy has the destination's local index.
* dispatch phase 1 (attention ranks of the node, one ``all_to_all_single`` on an intra-node group):
  each rank sends each proxy its rows for the destinations that proxy serves, ordered by
  destination. Rows for expert ranks of the *same* node skip this phase (they are already local).
* dispatch phase 2 (data group): each proxy sends each of its destinations one message holding
  that destination's rows from every rank of its node, in source-rank order; ranks also send their
  same-node rows directly. An expert rank therefore receives exactly the rows of the flat exchange,
  in the same order (by source rank, then as the source routed them): still one copy of a token
  per destination expert rank, and bit-identical expert inputs.
* combine reverses both: experts return partial sums to whoever sent the rows (phase 2 reversed),
  proxies scatter them back to their sources (phase 1 reversed), and each source puts its partial
  sums back in flat order before the same ``index_add_`` as the flat transport: bit-identical
  outputs.

Inter-node messages per layer drop by the number of attention ranks per node for the same
inter-node bytes; intra-node bytes grow by ``(m - 1) / m`` of the node's cross-node rows.

Every layer starts with one all-gather of each rank's row counts per expert rank (``W x E``
int64, a few KiB; it replaces the flat transport's count all-to-all). From this matrix, which all
ranks share, each rank derives every split of both phases, and the adaptive transport evaluates
the `CostModel` of both schemes, so all ranks choose the same scheme for the layer without
further messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitmoe.comm.cost_model import CostModel, Phase
from splitmoe.comm.distributed import Collective
from splitmoe.comm.handles import UNKNOWN_LAYER, DispatchHandle, ExpertBatch
from splitmoe.comm.stats import SCHEMES
from splitmoe.comm.topology import Topology
from splitmoe.comm.transport import Transport


def segment_index(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenated ``arange(starts[i], starts[i] + lengths[i])`` (int64, CPU, no Python loop)."""
    total = int(lengths.sum())
    if total == 0:
        return torch.empty(0, dtype=torch.int64)
    out_start = torch.cumsum(lengths, 0) - lengths  # where each segment lands in the output
    return torch.repeat_interleave(starts - out_start, lengths) + torch.arange(total)


@dataclass(frozen=True)
class NodeLayout:
    """Static part of the two-phase scheme, the same on every rank.

    attention_node: ``[A]`` node of each attention rank; expert_node: ``[E]``;
    members[n]: attention ranks of node ``n`` (a range, possibly empty);
    remote: ``[A, E]`` bool, expert rank on another node than the attention rank;
    proxy: ``[A, E]`` int64 world rank that forwards ``(attention rank, expert rank)`` rows in
    phase 1 (-1 where ``remote`` is False: those rows go directly);
    same_node_attention: ``[A, A]`` bool; off_diagonal: ``[A, A]`` int64 (0 on the diagonal).
    """

    num_attention: int
    num_expert: int
    num_nodes: int
    attention_node: torch.Tensor
    expert_node: torch.Tensor
    members: tuple[range, ...]
    remote: torch.Tensor
    proxy: torch.Tensor
    same_node_attention: torch.Tensor
    off_diagonal: torch.Tensor

    @classmethod
    def build(cls, topo: Topology) -> NodeLayout:
        A, E = topo.num_attention, topo.num_expert
        node = torch.tensor([topo.node_of(r) for r in range(topo.world_size)], dtype=torch.int64)
        members = tuple(
            range(min(r.start, A), min(r.stop, A))
            for r in (topo.ranks_of_node(n) for n in range(topo.num_nodes))
        )
        remote = node[:A, None] != node[None, A:]  # [A, E]
        proxy = torch.full((A, E), -1, dtype=torch.int64)
        for n, ranks in enumerate(members):
            if not ranks:
                continue
            far = (node[A:] != n).nonzero().flatten()  # expert indices on other nodes, ascending
            chosen = torch.tensor(ranks)[torch.arange(far.numel()) % len(ranks)]  # [|far|]
            proxy[ranks.start : ranks.stop, far] = chosen
        return cls(
            num_attention=A,
            num_expert=E,
            num_nodes=topo.num_nodes,
            attention_node=node[:A],
            expert_node=node[A:],
            members=members,
            remote=remote,
            proxy=proxy,
            same_node_attention=node[:A, None] == node[None, :A],
            off_diagonal=1 - torch.eye(A, dtype=torch.int64),
        )

    def traffic(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows per message of both phases from ``counts [A, E]`` (rows per attention rank and
        destination): ``phase1 [A, A]`` (source -> proxy, diagonal = kept by a proxy for itself)
        and ``phase2 [A, E]`` (proxy or direct sender -> expert rank)."""
        A = self.num_attention
        far = counts * self.remote  # [A, E] rows that cross nodes
        phase1 = torch.zeros(A, A, dtype=torch.int64).scatter_add_(1, self.proxy.clamp(min=0), far)
        per_node = torch.zeros(self.num_nodes, self.num_expert, dtype=torch.int64)
        per_node.index_add_(0, self.attention_node, far)  # [nodes, E]
        is_proxy = self.proxy == torch.arange(A)[:, None]  # [A, E]
        phase2 = counts - far + per_node[self.attention_node] * is_proxy
        return phase1, phase2

    def phases(
        self,
        counts: torch.Tensor,
        scheme: str,
        traffic: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> list[Phase]:
        """The cost model's view of a scheme on ``counts [A, E]`` (``traffic``: `traffic` of
        ``counts`` when already at hand)."""
        if scheme == "flat":
            return [Phase(counts, ~self.remote)]
        phase1, phase2 = traffic or self.traffic(counts)
        return [
            Phase(phase1 * self.off_diagonal, self.same_node_attention),  # self-copies: free
            Phase(phase2, ~self.remote),
        ]


def scheme_times(
    layout: NodeLayout,
    counts: torch.Tensor,
    dispatch_bytes: int,
    combine_bytes: int,
    cost_model: CostModel,
    traffic: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, float]:
    """Predicted seconds of one layer (dispatch + combine) under each scheme, for ``counts
    [A, E]`` rows per (attention rank, expert rank) of ``dispatch_bytes`` each, partial sums of
    ``combine_bytes`` each."""
    return {
        s: cost_model.scheme_time(layout.phases(counts, s, traffic), dispatch_bytes, combine_bytes)
        for s in SCHEMES
    }


@dataclass
class LayerPlan:
    """How one rank moves one layer's rows (derived from the shared count matrix).

    scheme: ``"flat"`` or ``"two_phase"``.
    aggregate: this rank runs phase 1 with the other attention ranks of its node (False for
        expert ranks, flat layers, single-attention-rank nodes and layers where no row of the node
        changes rank in phase 1; then phase-1 "received" rows are the rows sent to oneself).
    send1 / recv1: phase-1 rows to / from each attention rank of the node (node order).
    idx1: ``[rows to proxies]`` positions in this rank's flat-ordered rows, in phase-1 send order
        (None for flat).
    idx2: ``[phase-2 rows]`` positions in ``cat(phase-1 received rows, flat-ordered rows)``, in
        phase-2 send order (by destination, then source rank); None for flat (identity).
    send2 / recv2: phase-2 rows to / from each world rank.
    """

    scheme: str
    aggregate: bool = False
    send1: list[int] = field(default_factory=list)
    recv1: list[int] = field(default_factory=list)
    idx1: torch.Tensor | None = None
    idx2: torch.Tensor | None = None
    send2: list[int] = field(default_factory=list)
    recv2: list[int] = field(default_factory=list)

    @property
    def received1(self) -> int:
        return sum(self.recv1)


class TwoPhaseTransport(Transport):
    """Aggregating transport (see the module doc). The intra-node groups it creates use the
    constructor's ``timeout``; its ``cost_model`` only serves `choose` in the adaptive subclass."""

    name = "two_phase"

    def __init__(self, topo: Topology, *args, **kwargs):
        super().__init__(topo, *args, **kwargs)  # same arguments as every transport
        self.layout = NodeLayout.build(topo)
        self._attention_ranks = range(topo.num_attention)
        self.combine_bytes = self.hidden_size * self.elem
        # Phase-1 groups: the attention ranks of each node holding two or more. Every rank creates
        # every group, in node order, as torch.distributed requires.
        self.node_ranks = self.layout.members[topo.node] if topo.is_attention else range(0)
        # One per lane, like the data groups (see `Transport.lanes`).
        self.intra_groups: dict[str, Collective | None] = {}
        for lane in ("dispatch", "combine"):
            self.intra_groups[lane] = None
            for ranks in self.layout.members:
                if len(ranks) >= 2:
                    g = self.new_lane(list(ranks))
                    if g is not None:
                        self.intra_groups[lane] = g

    # ---- the per-layer plan -------------------------------------------------------------------
    def choose(
        self, counts: torch.Tensor, traffic: tuple[torch.Tensor, torch.Tensor], layer: int
    ) -> str:
        """Scheme for a layer with ``counts [A, E]`` and its two-phase ``traffic`` (the same on
        every rank)."""
        return "two_phase"

    def _gather_counts(self, mine: list[int], layer: int) -> torch.Tensor:
        """All ranks' rows per expert rank: ``[A, E]`` int64 on the CPU, identical everywhere."""
        W, E = self.topo.world_size, self.topo.num_expert
        send = torch.tensor(mine, dtype=torch.int64, device=self.comm_device)  # [E]
        out = torch.empty(W * E, dtype=torch.int64, device=self.comm_device)
        with self.stats.timed(layer, "counts"):
            # only attention ranks contribute: over shared memory they then post a layer
            # without waiting for the expert ranks to take part
            self.lanes["dispatch"].all_gather_from(out, send, self._attention_ranks)
            counts = out.view(W, E)[: self.topo.num_attention].cpu()
        return counts

    def _plan(self, counts: torch.Tensor, layer: int) -> LayerPlan:
        topo, lay = self.topo, self.layout
        A, E = topo.num_attention, topo.num_expert
        traffic = lay.traffic(counts)
        scheme = self.choose(counts, traffic, layer)
        self.stats.call(layer, scheme)
        # flat: counts are the phase-2 matrix, nothing is aggregated
        phase1, phase2 = traffic if scheme == "two_phase" else (None, counts)
        if not topo.is_attention:
            return LayerPlan(scheme, recv2=phase2[:, topo.expert_index].tolist() + [0] * E)
        if scheme == "flat":
            return LayerPlan(scheme, send2=[0] * A + counts[topo.rank].tolist())

        r, node = topo.rank, self.node_ranks
        lo, hi = node.start, node.stop
        mine = counts[r]  # [E] rows per destination, flat order
        offset = torch.cumsum(mine, 0) - mine  # [E] where each destination's rows start
        # Phase 1: rows for other nodes' expert ranks, ordered by (proxy, destination).
        far = lay.remote[r].nonzero().flatten()
        far = far[torch.argsort(lay.proxy[r, far] * E + far)]
        idx1 = segment_index(offset[far], mine[far])
        block1 = phase1[lo:hi, lo:hi]  # [m, m] within this node
        aggregate = bool((block1 - torch.diag(torch.diagonal(block1))).any())
        # Phase 2: the destinations this rank proxies get their rows from phase-1 received rows
        # (laid out by source, then destination); same-node destinations get this rank's own rows
        # (placed after the phase-1 rows). Ordered by destination, then source.
        served = (lay.proxy[r] == r).nonzero().flatten()  # [J] expert indices proxied here
        block = counts[lo:hi][:, served]  # [m, J] layout of the phase-1 received rows
        flat_block = block.flatten()
        start1 = (torch.cumsum(flat_block, 0) - flat_block).view(block.shape)
        local = (~lay.remote[r]).nonzero().flatten()
        keys = torch.cat([served.repeat_interleave(len(node)), local])
        starts = torch.cat([start1.t().flatten(), int(block.sum()) + offset[local]])
        lengths = torch.cat([block.t().flatten(), mine[local]])
        order = torch.argsort(keys, stable=True)
        idx2 = segment_index(starts[order], lengths[order])
        return LayerPlan(
            scheme,
            aggregate=aggregate,
            send1=phase1[r, lo:hi].tolist(),
            recv1=phase1[lo:hi, r].tolist(),
            idx1=idx1.to(self.device),
            idx2=idx2.to(self.device),
            send2=[0] * A + phase2[r].tolist(),
        )

    # ---- attention side -----------------------------------------------------------------------
    def dispatch(self, x, topk_ids, topk_weights, layer=UNKNOWN_LAYER):
        A = self.topo.num_attention
        token_index, rows, counts = self.route_rows(x, topk_ids, topk_weights)  # flat order

        def send() -> LayerPlan:  # both hops, in order, on the dispatch lane
            plan = self._plan(self._gather_counts(counts[A:], layer), layer)
            if plan.scheme == "flat":
                send2 = rows
            else:
                recv1 = self._phase1(
                    rows[plan.idx1], plan.send1, plan.recv1, plan, layer, "dispatch"
                )
                send2 = torch.cat([recv1, rows])[plan.idx2]  # [rows out, row_bytes]
            self.all_to_all(send2, plan.send2, self._zeros, layer, "dispatch")
            return plan

        # (over shared memory this runs now: it waits for the node's other attention ranks,
        # which post the same layer, and never for the expert ranks)
        sent = self.post("dispatch", send, sends=True, inputs=(rows,))
        return DispatchHandle(
            token_index=token_index,
            send_counts=counts,
            num_tokens=x.shape[0],
            layer=layer,
            sent=sent,
        )

    def combine(self, handle):
        plan: LayerPlan = handle.plan  # (waits for the dispatch)
        got = self.post("combine", lambda: self._partial_sums(handle, plan), sends=False)
        partial = got.wait()  # [P, H]
        out = torch.zeros(handle.num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        out.index_add_(0, handle.token_index, partial)  # same order of additions as flat
        return out

    def _partial_sums(self, handle: DispatchHandle, plan: LayerPlan) -> torch.Tensor:
        """Both hops back: the partial sums ``[P, H]`` in the flat order of the sent rows."""
        H = self.hidden_size
        recv2 = self.all_to_all(self._no_sums, self._zeros, plan.send2, handle.layer, "combine")
        if plan.scheme == "flat":
            return recv2
        # Undo phase 2's gather, then phase 1: copies only, so every partial sum is bit-exact.
        n1 = plan.received1
        back = torch.empty(n1 + handle.token_index.numel(), H, dtype=self.dtype, device=self.device)
        back[plan.idx2] = recv2
        got1 = self._phase1(back[:n1], plan.recv1, plan.send1, plan, handle.layer, "combine")
        partial = back[n1:]  # [P, H]: same-node destinations filled, the rest from phase 1
        partial[plan.idx1] = got1
        return partial

    def _phase1(self, send, send_counts, recv_counts, plan, layer, direction):
        if not plan.aggregate:
            return send  # every phase-1 row of this node stays on its rank
        return self.all_to_all(
            send,
            send_counts,
            recv_counts,
            layer,
            direction,
            stage="aggregate",
            group=self.intra_groups[direction],
            peers=self.node_ranks,
        )

    # ---- expert side --------------------------------------------------------------------------
    def receive(self, layer=UNKNOWN_LAYER):
        def receive() -> tuple[torch.Tensor, list[int], LayerPlan]:
            plan = self._plan(self._gather_counts([0] * self.topo.num_expert, layer), layer)
            rows = self.all_to_all(self._no_rows, self._zeros, plan.recv2, layer, "dispatch")
            return rows, plan.recv2, plan

        return ExpertBatch(self.post("dispatch", receive, sends=False), self.unpack, layer)


class AutoTransport(TwoPhaseTransport):
    """Per layer, the scheme the cost model predicts faster (flat on a tie).

    Both predictions (seconds per layer, dispatch + combine) are added to the layer's
    ``predicted_s`` statistics.
    """

    name = "auto"

    def choose(self, counts, traffic, layer):
        t = scheme_times(
            self.layout, counts, self.row_bytes, self.combine_bytes, self.cost_model, traffic
        )
        predicted = self.stats.record(layer)["predicted_s"]
        for s, v in t.items():
            predicted[s] += v
        return "two_phase" if t["two_phase"] < t["flat"] else "flat"
