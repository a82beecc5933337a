"""The microsecond balancer: per (layer, micro-batch), which replica serves each (token, expert).

Given a token's top-k experts ``topk_ids [T, k]`` and the layer's `ReplicaTable` (from the
`Placement`), every policy returns ``slots [T, k]`` (global slot ids, each holding the pair's
expert), which the transport routes by slot. Vectorised tensor code, no loop over tokens or
experts; integer arithmetic only, so every attention rank reaches bit-identical decisions.

* ``static``: attention rank ``a`` always uses replica ``a mod replicas(e)`` of expert ``e`` (the
  baseline: load spreads only across attention ranks).
* ``local``: each attention rank deals its own pairs of ``e`` round-robin over the replicas
  (starting at replica ``a``), no coordination.
* ``global``: the attention ranks all-gather per-expert pair counts ``[A, E]`` (one small
  collective per layer and micro-batch) and all run `global_quota`: per expert, how many of its
  pairs each replica takes, minimising the busiest expert rank's cost
  ``activate x distinct experts it runs + pairs it computes`` (`ExpertCost`). Attention rank
  ``a``'s pairs of ``e`` are the consecutive range ``prefix[a, e] ..`` of the global order, cut
  by the quotas, so together the ranks fill every replica exactly to its quota.

`global_quota` is a water-filling, vectorised over experts: each expert spreads its pairs over its
replicas' ranks so that they end level (counting the activation cost of every replica it uses),
against the cost the other experts put on those ranks (estimated as even splits).

Speed: the decision runs before every dispatch (issue 6: <= 100 us on one CPU core for 512
tokens x top-8 x 256 experts x 32 expert ranks; see docs/balancer.md and
`scripts/bench_balancer.py`). On CPU an eager torch call costs ~1-2 us however small its tensors,
so the per-step code is a short fixed sequence of calls (~30 for ``global``): everything that
depends only on the placement is in `ReplicaTable`; only the experts with more than one replica
(``E2 <= R``) are water-filled and cut; `deal` hands out the pairs with one sort (numpy's radix
sort on CPU). No host synchronisation, so the same code runs on a GPU.

This tensor code is the reference: CPU ranks decide with the native kernel
(`splitmoe.kernels.balance_cpu`, one C call per layer, two for ``global``; ~9 us for ``global``
at that shape), CUDA ranks with Triton kernels (`splitmoe.kernels.balance_triton`, one launch
per layer, two for ``global``, graph-capturable); both make the same choices bit for bit
(`Balancer` ``kernel``).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from sys import getrefcount
from typing import TYPE_CHECKING

import numpy as np
import torch

from splitmoe.config import BALANCER_POLICIES
from splitmoe.kernels import balance_cpu
from splitmoe.kernels.expert_sort import count_keys
from splitmoe.kernels.triton_utils import require_triton
from splitmoe.scheduler.placement import Placement

if TYPE_CHECKING:
    from splitmoe.comm.distributed import Collective

POLICIES = BALANCER_POLICIES
# Which code makes the decision: "auto" is the native CPU kernel on CPU ranks (`balance_cpu`),
# the Triton kernels on CUDA ranks (`balance_triton`); "torch" is the reference everywhere
# (tests, benchmarks).
KERNELS = ("auto", "native", "triton", "torch")
logger = logging.getLogger("splitmoe")
_BIG = 1 << 50  # cost of a padding replica: never worth using
_storage_uses = torch._C._storage_Use_Count  # tensors and views sharing a storage (`_output`)


@dataclass(frozen=True)
class ExpertCost:
    """Cost of an expert rank for one layer, in units of one (token, expert) pair's compute:
    ``activate`` per distinct expert it runs (reading its weights) + 1 per pair it computes.

    `from_hardware` derives ``activate`` from a roofline: an expert's weights read at memory
    bandwidth versus one token's FLOPs (H100, Qwen3-235B expert: ~35 us vs ~0.05 us).
    """

    activate: int = 64

    @classmethod
    def from_hardware(
        cls, hidden: int, inter: int, weight_bytes: int, mem_bytes_per_s: float, flops: float
    ) -> ExpertCost:
        read_s = 3 * hidden * inter * weight_bytes / mem_bytes_per_s
        token_s = 6 * hidden * inter / flops
        return cls(activate=max(1, round(read_s / token_s)))


@dataclass(frozen=True)
class ReplicaTable:
    """One layer's replicas, with everything the per-step choice needs that does not depend on
    the step's routing (`Balancer.set_placement` builds one per layer; int64 on the device).

    * ``replica_slots [E, M]``: slot of replica ``j`` of expert ``e`` (padded with the first
      replica); ``num_replicas [E]``; ``replica_rank [E, M]``: expert rank of each replica;
      ``num_ranks``.
    * ``multi [E2, 1]``: the experts with more than one replica, the only ones with a choice
      (``E2 <= R``: 14 of 256 experts for the bench's Zipf 1.0 placement with R = 32);
      ``multi_at [E2, M]``: their rows' flat indices into ``[E, M]``; ``multi_replicas [E2, 1]``;
      ``multi_pad [E2, M]``: 0 on a replica, `_BIG` on padding.
    * ``others_at [K]``, ``others_expert [K]``: for every replica of a multi expert (flat index
      into ``[E2, M]``), each other slot on its expert rank and the expert that slot holds:
      `global_quota` sums the other experts' cost on a replica's rank with one ``put``.
    * ``col [1, M]``: replica index ``j``; ``count [1, M]``: ``j + 1``; ``first [M]``: 1 at
      ``j = 0``.
    """

    replica_slots: torch.Tensor
    num_replicas: torch.Tensor
    replica_rank: torch.Tensor
    num_ranks: int
    multi: torch.Tensor
    multi_at: torch.Tensor
    multi_replicas: torch.Tensor
    multi_pad: torch.Tensor
    others_at: torch.Tensor
    others_expert: torch.Tensor
    col: torch.Tensor
    count: torch.Tensor
    first: torch.Tensor

    @classmethod
    def build(
        cls, placement: Placement, layer: int, device: torch.device | str = "cpu"
    ) -> ReplicaTable:
        row = placement.row(layer)  # [S] expert of each slot
        E, S = placement.num_experts, row.numel()
        order = torch.argsort(row, stable=True)  # slots grouped by expert, ascending slot id
        num = torch.bincount(row, minlength=E)  # [E]
        M = int(num.max())
        start = torch.cumsum(num, 0) - num
        j = torch.arange(M)
        slots = order[start[:, None] + torch.minimum(j[None, :], num[:, None] - 1)]  # [E, M]
        rank = placement.slot_rank[slots]  # [E, M]
        multi = torch.nonzero(num > 1)  # [E2, 1]
        real = j[None, :] < num[multi]  # [E2, M]
        # (replica of a multi expert, another slot on its rank) pairs: rank of the replica's
        # slot == rank of the other slot, other != itself; padding replicas have none
        own = slots[multi[:, 0]].flatten()  # [E2 * M]
        same = placement.slot_rank[None, :] == placement.slot_rank[own][:, None]  # [E2 * M, S]
        same &= torch.arange(S)[None, :] != own[:, None]
        same &= real.flatten()[:, None]
        at, other = same.nonzero(as_tuple=True)
        tensors = {
            "replica_slots": slots,
            "num_replicas": num,
            "replica_rank": rank,
            "multi": multi,
            "multi_at": multi * M + j[None, :],
            "multi_replicas": num[multi],
            "multi_pad": torch.where(real, 0, _BIG),
            "others_at": at,
            "others_expert": row[other],
            "col": j[None, :],
            "count": j[None, :] + 1,
            "first": (j == 0).long(),
        }
        return cls(num_ranks=placement.num_ranks, **{k: v.to(device) for k, v in tensors.items()})


def global_quota(table: ReplicaTable, totals: torch.Tensor, cost: ExpertCost) -> torch.Tensor:
    """``totals [E]`` int64 pairs per expert (all attention ranks) -> ``quota [E2, M]`` int64
    pairs per replica of each multi-replica expert ``table.multi`` (zero on padding), rows
    summing to ``totals[table.multi]`` (single-replica experts take all their pairs)."""
    ends, order = _water_fill(table, totals, cost)
    ends = ends.clamp_(max=totals.take(table.multi))
    quota = torch.diff(ends, dim=1, prepend=torch.zeros_like(ends[:, :1]))
    return quota.scatter(1, order, quota)


def _water_fill(
    table: ReplicaTable, totals: torch.Tensor, cost: ExpertCost
) -> tuple[torch.Tensor, torch.Tensor]:
    """`global_quota` as ``(ends [E2, M], order [E2, M])``: multi expert ``e``'s replica
    ``order[e, i]`` takes the pairs ``ends[e, i - 1] .. ends[e, i]`` of its global order
    (``ends[e, -1] = 0``; after its last used replica ``ends >= totals[e]``: clamp).

    Per expert, its replicas sorted by ``c`` (their rank's cost from the other experts, which
    under even splits add ``activate + share`` per replica they use): using the cheapest ``m``
    levels them at ``L(m) = (c_0 + .. + c_(m-1) + pairs) // m``. ``L`` falls while the next
    replica is below it and rises after, so its first minimum gives ``m``; replica ``i < m``
    takes ``L - c_i`` pairs, +1 if ``i < rem = (c_0 + .. + c_(m-1) + pairs) % m``: the pairs
    left after replica ``i`` are ``c_0 + .. + c_i + pairs - (i + 1) L - min(i + 1, rem)``.
    (The expert's own activation is the same on each of its replicas and only shifts ``L``:
    left out.)"""
    share = totals // table.num_replicas  # [E] even split
    own = torch.add(share, share.clamp(max=1), alpha=cost.activate)  # [E] cost per replica
    c = table.multi_pad.put(table.others_at, own.take(table.others_expert), accumulate=True)
    c, order = torch.sort(c, dim=1, stable=True)  # [E2, M] cheapest replica first
    n = totals.take(table.multi)  # [E2, 1]
    t = c.cumsum(1).add_(n)  # [E2, M] c_0 + .. + c_j + pairs
    level = t // table.count  # L(j + 1)
    lvl, used = level.min(1, keepdim=True)  # [E2, 1] L and m - 1
    rem = (t % table.count).gather(1, used)
    # [E2, M] pairs left after replica j: 0 at the last used one, running minimum <= 0 after
    left = torch.addcmul(t, table.count, lvl, value=-1).sub_(torch.minimum(table.count, rem))
    return n - left.cummin(1).values, order


class LoadStats:
    """Pairs routed to each expert of each MoE layer, as seen by this attention rank:
    ``window [L, E]`` since the last rebalance and ``total [L, E]`` since start (int64, CPU).

    `add` accumulates on the balancer's device (no host copy per step); reading ``window`` or
    ``total`` folds those counts in (and ``window.zero_()`` restarts the window)."""

    def __init__(self, layers: tuple[int, ...], num_experts: int, device: torch.device | str):
        self.layers = tuple(layers)
        self.num_experts = num_experts
        self._pending = torch.zeros(len(layers), num_experts, dtype=torch.int64, device=device)
        self._rows = {layer: self._pending[i] for i, layer in enumerate(self.layers)}
        # on the CPU, `count` adds numpy's bincount into these views of the same memory
        cpu = self._pending.device.type == "cpu"
        self._rows_np = {k: v.numpy() for k, v in self._rows.items()} if cpu else None
        self._window = torch.zeros(len(layers), num_experts, dtype=torch.int64)
        self._total = torch.zeros_like(self._window)

    def row_ptr(self, layer: int) -> int:
        """Address of ``layer``'s pending counts (``[E]`` int64, CPU): the native kernel adds
        into it."""
        return self._rows[layer].data_ptr()

    def row(self, layer: int) -> torch.Tensor:
        """``layer``'s pending counts ``[E]`` int64 on the balancer's device (kernels add in)."""
        return self._rows[layer]

    def add(self, layer: int, counts: torch.Tensor) -> None:
        self._rows[layer].add_(counts)

    def count(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Adds the pairs of ``topk_ids [T, k]`` (expert ids) to ``layer``'s counts. On the CPU
        one numpy ``bincount`` (~3 us against ~15 us for `expert_counts` and ``add_`` at 16 x 4
        pairs: the static policy pays only this per layer and micro-batch)."""
        if self._rows_np is None:
            self.add(layer, expert_counts(topk_ids, self.num_experts))
        else:
            flat = topk_ids.numpy().reshape(-1)
            self._rows_np[layer] += np.bincount(flat, minlength=self.num_experts)

    def _fold(self) -> None:
        pending = self._pending.cpu()
        self._window += pending
        self._total += pending
        self._pending.zero_()

    @property
    def window(self) -> torch.Tensor:
        self._fold()
        return self._window

    @property
    def total(self) -> torch.Tensor:
        self._fold()
        return self._total

    def snapshot(self) -> dict:
        return {
            "layers": list(self.layers),
            "window": self.window.tolist(),
            "total": self.total.tolist(),
        }


class Balancer:
    """Per-step replica choice of one attention rank (see the module doc).

    ``group``: the attention ranks only (the ``global`` policy's count all-gather; None with one
    attention rank). `choose` is called in (layer, micro-batch) order on every attention rank.
    """

    def __init__(
        self,
        policy: str,
        placement: Placement,
        attention_rank: int,
        num_attention: int,
        cost: ExpertCost,
        device: torch.device,
        group: Collective | None = None,
        comm_device: torch.device | None = None,
        kernel: str = "auto",
    ):
        if policy not in POLICIES:
            raise ValueError(f"balancer={policy!r} must be one of {POLICIES}")
        if kernel not in KERNELS:
            raise ValueError(f"balancer kernel={kernel!r} must be one of {KERNELS}")
        self.policy = policy
        self.attention_rank = attention_rank
        self.num_attention = num_attention
        self.cost = cost
        self.device = torch.device(device)
        self.group = group
        self.comm_device = comm_device or torch.device("cpu")
        self.kernel = resolve_kernel(kernel, self.device)
        self._lib = balance_cpu.library() if self.kernel == "native" else None
        if self._lib is not None:  # the C functions, bound once (each lookup costs ~0.1 us)
            lib = self._lib
            self._smb_static, self._smb_count = lib.smb_static, lib.smb_count
            self._smb_local, self._smb_global = lib.smb_local, lib.smb_global
        self._outs: dict[int, tuple] = {}  # layer -> its last output (`_output`)
        self._triton = _triton_module() if self.kernel == "triton" else None
        self.load = LoadStats(placement.layers, placement.num_experts, self.device)
        E = placement.num_experts
        # the count all-gather's buffers, reused every call (consumed before the next one)
        self._counts = torch.zeros(E, dtype=torch.int64, device=self.device)
        self._counts_ptr, self._num_experts = self._counts.data_ptr(), E
        self._gathered = torch.zeros(num_attention * E, dtype=torch.int64, device=self.comm_device)
        self._gathered_rows = self._gathered.view(num_attention, E)  # [A, E]
        self._same_device = self.comm_device == self.device
        self.set_placement(placement)

    def set_placement(self, placement: Placement, layers: tuple[int, ...] | None = None) -> None:
        """Switches to a new placement (between steps, on every rank at the same step);
        ``layers``: only these layers' rows changed (a rebalance switches layer by layer)."""
        self.placement = placement
        if layers is None:
            layers = placement.layers
            self.tables: dict[int, ReplicaTable] = {}
            self._static: dict[int, torch.Tensor | None] = {}
            self._native: dict[int, tuple] = {}
            self._tri: dict[int, object] = {}
        # ``static``: this rank's slot of each expert, fixed per placement ([E] int64); None
        # where that slot is the expert id itself (one replica each, slots in expert order)
        experts = torch.arange(placement.num_experts, device=self.device)
        for layer in layers:
            table = self.tables[layer] = ReplicaTable.build(placement, layer, self.device)
            mine = assign("static", table, experts[:, None], self.attention_rank, self.cost, None)
            self._static[layer] = None if torch.equal(mine[:, 0], experts) else mine[:, 0]
            if self._lib is not None:
                native = balance_cpu.Table.build(
                    table, mine[:, 0], placement.row(layer), placement.slot_rank
                )
                # the table, what it points into, the layer's load counts (a fixed address)
                # (table address, load counts address), what the table points into
                self._native[layer] = ((ctypes.addressof(native), self.load.row_ptr(layer)), native)
            if self._triton is not None:
                self._tri[layer] = self._triton.Tables(
                    table, mine[:, 0], placement.row(layer), placement.slot_rank,
                    _direct(table),
                )  # fmt: skip

    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts [E]`` of this rank -> ``[A, E]`` of every attention rank (rank order)."""
        if self.group is None:
            return counts[None, :]
        self.group.all_gather_single(self._gathered, counts.to(self.comm_device))
        return self._gathered_rows if self._same_device else self._gathered_rows.to(self.device)

    def choose(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """``topk_ids [T, k]`` -> ``slots [T, k]`` int64 (collective for ``global``)."""
        if self._lib is not None:
            return self._choose_native(layer, topk_ids)
        if self._triton is not None:
            return self._choose_triton(layer, topk_ids)
        if self.policy == "static":  # a fixed lookup (the same as `assign`'s); counts only kept
            self.load.count(layer, topk_ids)
            mine = self._static[layer]
            return topk_ids.long() if mine is None else mine.take(topk_ids.long())
        counts = expert_counts(topk_ids, self.placement.num_experts)  # [E]
        self.load.add(layer, counts)
        all_counts = self.gather_counts(counts) if self.policy == "global" else None
        table = self.tables[layer]
        return assign(
            self.policy, table, topk_ids, self.attention_rank, self.cost, counts, all_counts
        )

    def _choose_native(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """`choose` with the native CPU kernel: one call per layer (``global``: count, the
        all-gather, then quotas and deal), identical to `assign`. Per call the Python around
        the C is kept to a few attribute reads (~1 us against ~1.5 us of C for ``static`` at
        4096 pairs): the layer's table address and load row in one tuple, the output reused."""
        table, load = self._native[layer][0]
        ids = topk_ids if topk_ids.dtype is torch.int64 else topk_ids.long()
        if not ids.is_contiguous():
            ids = ids.contiguous()
        out = self._output(layer, ids)
        P, at, to = ids.numel(), ids.data_ptr(), out.data_ptr()
        policy = self.policy
        if policy == "static":
            rc = self._smb_static(table, at, P, to, load)
        else:
            counts = self._counts_ptr
            rc = self._smb_count(at, P, self._num_experts, counts, load)
            if rc == 0 and policy == "local":
                rc = self._smb_local(table, at, P, self.attention_rank, counts, to)
            elif rc == 0:
                gathered = self.gather_counts(self._counts)
                rc = self._smb_global(
                    table, at, P, self.attention_rank, gathered.shape[0], gathered.data_ptr(),
                    counts, self.cost.activate, to,
                )  # fmt: skip
        if rc:
            balance_cpu.check(rc)
        return out

    def _output(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """An int64 tensor shaped as ``ids`` for the layer's slots: the layer's previous one
        when nothing but the balancer refers to it any more (the transport consumes the slots
        within `dispatch`), else a new one (``torch.empty_like`` costs ~0.8 us: a quarter of
        ``static``'s time). A caller that keeps a result, or a view or array of it, keeps it
        intact: its Python references and its storage's use count are checked."""
        kept = self._outs.get(layer)
        if kept is not None:
            out, storage, uses = kept
            # 3: ``kept``, ``out`` and getrefcount's argument; ``uses``: the count when new
            if getrefcount(out) == 3 and _storage_uses(storage) == uses and out.shape == ids.shape:
                return out
        out = torch.empty_like(ids)
        storage = out.untyped_storage()._cdata
        self._outs[layer] = (out, storage, _storage_uses(storage))
        return out

    def _choose_triton(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """`choose` with the Triton kernels: one launch per layer (``global``: counts, the
        all-gather, then quotas and deal), no host synchronisation, identical to `assign`."""
        kernels, t = self._triton, self._tri[layer]
        ids = topk_ids.contiguous()
        out = torch.empty(ids.shape, dtype=torch.int64, device=ids.device)
        load = self.load.row(layer)
        if self.policy == "static":
            kernels.static(t, ids, out, load)
        elif self.policy == "local":
            kernels.local(t, ids, self.attention_rank, self._counts, load, out)
        else:
            kernels.count(t, ids, self._counts, load)
            gathered = self.gather_counts(self._counts).contiguous()
            kernels.global_(t, ids, self.attention_rank, gathered, self.cost.activate, out)
        return out


def _triton_module():
    from splitmoe.kernels import balance_triton  # imports triton: only on the ranks using it

    return balance_triton


def _direct(table: ReplicaTable) -> torch.Tensor:
    """``[E]``: a single-replica expert's slot, else ``-1 - q`` (its row among the multi
    experts), as the kernels' deal reads it."""
    direct = table.replica_slots[:, 0].clone()
    direct[table.multi[:, 0]] = -1 - torch.arange(table.multi.shape[0], device=direct.device)
    return direct


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """``"auto"``: ``"native"`` on a CPU device when the C kernel builds, else ``"torch"`` (on
    a CPU without a C compiler with one warning naming the cause: the decision is the same,
    only slower); ``"triton"`` on CUDA when triton is installed, else ``"torch"``.
    ``"native"`` off the CPU, or without a compiler, is an error; so is ``"triton"`` without
    triton or (outside ``TRITON_INTERPRET=1``) off CUDA."""
    if kernel == "triton":
        require_triton("balancer kernel", device)
        return "triton"
    if kernel == "auto" and device.type == "cuda":
        try:
            require_triton("balancer kernel", device)
        except RuntimeError:
            return "torch"
        return "triton"
    if kernel == "torch" or (kernel == "auto" and device.type != "cpu"):
        return "torch"
    if device.type != "cpu":
        raise ValueError(f"balancer kernel='native' runs on CPU ranks, not on {device}")
    try:
        balance_cpu.library()
    except balance_cpu.NativeUnavailable as e:
        if kernel == "native":
            raise
        if not _warned[0]:
            logger.warning("%s; the balancer falls back to its (slower) PyTorch reference", e)
            _warned[0] = True
        return "torch"
    return "native"


_warned = [False]  # the missing-compiler warning, once per process


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``topk_ids [T, k]`` -> pairs per expert ``[E]`` int64, with no host synchronisation on a
    GPU (`count_keys`)."""
    return count_keys(topk_ids.long(), num_experts)


def assign(
    policy: str,
    table: ReplicaTable,
    topk_ids: torch.Tensor,
    attention_rank: int,
    cost: ExpertCost,
    counts: torch.Tensor,
    all_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The slot of every pair of ``topk_ids [T, k]`` (a token's experts distinct) on attention
    rank ``attention_rank`` under ``policy``; ``counts [E]``: this rank's pairs per expert
    (`expert_counts`); ``all_counts [A, E]`` (``global`` only): every attention rank's, in rank
    order. Returns ``[T, k]`` int64.

    ``static`` gathers one replica per expert. The others decide how many of this rank's pairs
    of each expert each replica takes (``take [E, M]``: single-replica experts all on replica 0,
    only the multi experts' rows computed) and `deal` hands them out: which of an expert's pairs
    go where does not matter, only how many."""
    a = attention_rank
    if policy == "static":
        mine = table.replica_slots.gather(1, (a % table.num_replicas)[:, None])  # [E, 1]
        return mine.take(topk_ids.long())
    mine = counts.take(table.multi)  # [E2, 1] this rank's pairs of the multi experts
    if policy == "local":
        # pair o (0-based, in expert-sorted order) goes to replica (a + o) mod n: replica j
        # takes the o < mine with o = j - a (mod n), (mine + (a - 1 - j) mod n) // n of them
        n = table.multi_replicas
        take_m = (((a - 1) - table.col) % n).add_(mine).div_(n, rounding_mode="floor")
        take_m.masked_fill_(table.multi_pad > 0, 0)  # [E2, M]
    else:
        upto = all_counts.cumsum(0)  # [A, E] pairs of ranks <= a
        ends, order = _water_fill(table, upto[-1], cost)  # [E2, M], sorted replicas
        hi = upto[a].take(table.multi)  # [E2, 1] this rank's range [lo, hi) of the global order
        lo = hi - mine
        take_m = torch.diff(ends.clamp_(lo, hi), dim=1, prepend=lo)
        take_m = take_m.scatter(1, order, take_m)
    take = torch.outer(counts, table.first).put_(table.multi_at, take_m)  # [E, M]
    return deal(topk_ids, table.replica_slots, take)


def deal(topk_ids: torch.Tensor, replica_slots: torch.Tensor, take: torch.Tensor) -> torch.Tensor:
    """``topk_ids [T, k]`` int64, ``replica_slots [E, M]``, ``take [E, M]`` (pairs of expert
    ``e`` for replica ``j``; row ``e`` sums to the pairs of ``e`` in ``topk_ids``) ->
    ``slots [T, k]`` int64: the pairs of ``e``, in row-major order, go ``take[e, 0]`` to
    ``replica_slots[e, 0]``, the next ``take[e, 1]`` to ``replica_slots[e, 1]``, ...

    One stable sort of the pairs by expert, one ``repeat_interleave``, one scatter. On CPU in
    numpy (zero-copy views): its stable argsort of 16-bit keys is a radix sort, ~3x faster than
    ``torch.sort`` at 4096 pairs (~8 vs ~21 us), and the three calls cost ~15 us instead of
    ~35; `deal_reference` (the same in torch) runs on other devices."""
    if topk_ids.device.type != "cpu" or replica_slots.shape[0] > 1 << 16:
        return deal_reference(topk_ids, replica_slots, take)
    ids = topk_ids.numpy().reshape(-1)
    order = np.argsort(ids.astype(np.uint16), kind="stable")
    out = np.empty(ids.shape, dtype=np.int64)
    out[order] = np.repeat(replica_slots.numpy().reshape(-1), take.numpy().reshape(-1))
    return torch.from_numpy(out.reshape(topk_ids.shape))


def deal_reference(
    topk_ids: torch.Tensor, replica_slots: torch.Tensor, take: torch.Tensor
) -> torch.Tensor:
    """`deal` in torch (any device)."""
    ids = topk_ids.reshape(-1)
    _, order = torch.sort(ids, stable=True)  # [P] pairs grouped by expert
    slots = torch.repeat_interleave(replica_slots.view(-1), take.view(-1), output_size=ids.numel())
    return slots.scatter(0, order, slots).view(topk_ids.shape)


def rank_loads(
    table: ReplicaTable, slots: torch.Tensor, slot_rank: torch.Tensor, cost: ExpertCost
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ``slots`` (every attention rank's, concatenated): per expert rank, ``(cost, pairs,
    distinct slots)`` (int64 ``[R]`` each)."""
    flat = slots.reshape(-1)
    R = table.num_ranks
    S = slot_rank.numel()
    per_slot = torch.bincount(flat, minlength=S)  # [S]
    pairs = torch.zeros(R, dtype=torch.int64).index_add_(0, slot_rank, per_slot)
    active = torch.zeros(R, dtype=torch.int64).index_add_(0, slot_rank, (per_slot > 0).long())
    return cost.activate * active + pairs, pairs, active
