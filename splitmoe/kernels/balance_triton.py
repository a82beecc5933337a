"""The balancer's per-layer replica choice as Triton kernels (CUDA ranks): one launch per layer
(two for ``global``: the counts before the count all-gather, the quotas and the deal after), no
host synchronisation (capturable in a CUDA graph), integer arithmetic only, and bit-identical to
the PyTorch reference `splitmoe.eplb.policy.assign` (tested under ``TRITON_INTERPRET=1``).

* ``static``: a grid over the pairs; each pair's slot is a lookup, the load counts an integer
  ``atomic_add`` (order-free, so deterministic).
* ``local`` / ``global`` run in one program (the decision is a few thousand pairs; one program
  keeps the per-expert running order without atomics):

  1. counts: a one-hot ``[BLOCK, E]`` sum per block of pairs (``global``: its own launch, the
     counts feed the all-gather; the second launch reads this rank's row of the gathered counts).
  2. quotas, one ``[E2, M]`` tile (the multi-replica experts x their replicas): ``local``'s
     round-robin counts in closed form; ``global``'s water-filling: each replica's rank cost from
     the other slots (per-slot even-split cost summed per rank, through a small scratch row),
     the stable sort by cost as ``tl.sort`` of ``cost * M + j`` (unique keys: stable by
     construction), cumulative sum, ``tl.argmin`` (first minimum, as ``torch.min``), the running
     minimum of the pairs left (an associative scan), this rank's cut ``[lo, hi)``. The cut's
     previous end comes from the same formula at ``i - 1`` (no shift), and the quotas return to
     replica order with a second ``tl.sort`` of ``replica << 40 | quota``; their cumulative sum
     goes to a scratch ``[E2, M]``.
  3. deal: blocks of pairs in order; a pair's position ``o`` among its expert's pairs is the
     running per-expert count (registers) plus its rank in the block (a one-hot cumulative
     sum); a single-replica expert's pair takes its slot, a multi expert's the first replica
     whose cumulative quota exceeds ``o`` - exactly the reference's stable sort, repeat, scatter.

Expert ids are not validated here (no host round trip on the GPU; they come from the router's
top-k); an id outside ``[0, E)`` is masked out of every load and store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitmoe.kernels.triton_utils import next_pow2

_BIG = tl.constexpr(1 << 50)  # a padding replica's cost (the reference's `_BIG`)
_INF = tl.constexpr(1 << 60)
BLOCK = 32  # pairs per step of the count and deal loops


@triton.jit
def _count(ids, P, E, counts, load, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """``counts [E]`` = pairs per expert (written), ``load [E]`` += counts."""
    offs = tl.arange(0, BLOCK)
    ex = tl.arange(0, E_PAD)
    acc = tl.zeros([E_PAD], dtype=tl.int64)
    for start in range(0, P, BLOCK):
        m = start + offs < P
        e = tl.load(ids + start + offs, mask=m, other=-1).to(tl.int64)
        acc += tl.sum((e[:, None] == ex[None, :]).to(tl.int64), axis=0)
    em = ex < E
    tl.store(counts + ex, acc, mask=em)
    tl.store(load + ex, tl.load(load + ex, mask=em, other=0) + acc, mask=em)


@triton.jit
def _deal(ids, P, E, M, slots, direct, counts, cum, out,
          E_PAD: tl.constexpr, M_PAD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Pair ``o`` (in order) of expert ``e`` -> ``direct[e]`` when >= 0 (one replica), else the
    replica ``j`` of row ``q = -1 - direct[e]`` with ``cum[q, j - 1] <= o < cum[q, j]``."""
    offs = tl.arange(0, BLOCK)
    ex = tl.arange(0, E_PAD)
    jj = tl.arange(0, M_PAD)
    cursor = tl.zeros([E_PAD], dtype=tl.int64)
    for start in range(0, P, BLOCK):
        m = start + offs < P
        e = tl.load(ids + start + offs, mask=m, other=-1).to(tl.int64)
        ok = m & (e >= 0) & (e < E)
        hot = (e[:, None] == ex[None, :]).to(tl.int64)  # [BLOCK, E_PAD]
        before = tl.cumsum(hot, axis=0) - hot + cursor[None, :]
        o = tl.sum(hot * before, axis=1)  # [BLOCK] position among the expert's pairs
        cursor += tl.sum(hot, axis=0)
        d = tl.load(direct + e, mask=ok, other=0)
        q = tl.where(d < 0, -1 - d, 0)
        c = tl.load(cum + q[:, None] * M_PAD + jj[None, :], mask=ok[:, None] & (d < 0)[:, None],
                    other=0)  # fmt: skip
        j = tl.sum((c <= o[:, None]).to(tl.int64), axis=1)
        s = tl.load(slots + e * M + j, mask=ok & (d < 0), other=0)
        tl.store(out + start + offs, tl.where(d < 0, s, d), mask=ok)


@triton.jit
def static_kernel(ids, P, E, static_slot, out, load, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < P
    e = tl.load(ids + offs, mask=m, other=0).to(tl.int64)
    ok = m & (e >= 0) & (e < E)
    tl.store(out + offs, tl.load(static_slot + e, mask=ok, other=0), mask=ok)
    tl.atomic_add(load + e, tl.full([BLOCK], 1, tl.int64), mask=ok)


@triton.jit
def count_kernel(ids, P, E, counts, load, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    _count(ids, P, E, counts, load, E_PAD, BLOCK)


@triton.jit
def local_kernel(ids, P, E, M, a, nrep, slots, multi, E2, direct, counts, load, cum, out,
                 E_PAD: tl.constexpr, E2_PAD: tl.constexpr, M_PAD: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    _count(ids, P, E, counts, load, E_PAD, BLOCK)
    tl.debug_barrier()
    qq = tl.arange(0, E2_PAD)
    jj = tl.arange(0, M_PAD)
    qm = qq < E2
    e = tl.load(multi + qq, mask=qm, other=0)
    n = tl.load(nrep + e, mask=qm, other=1)[:, None]
    mine = tl.load(counts + e, mask=qm, other=0)[:, None]
    r = (a - 1 - jj[None, :]) % n
    r = tl.where(r < 0, r + n, r)
    take = tl.where(jj[None, :] < n, (r + mine) // n, 0)
    tl.store(cum + qq[:, None] * M_PAD + jj[None, :], tl.cumsum(take, axis=1), mask=qm[:, None])
    tl.debug_barrier()
    _deal(ids, P, E, M, slots, direct, counts, cum, out, E_PAD, M_PAD, BLOCK)


@triton.jit
def _min(x, y):
    return tl.minimum(x, y)


@triton.jit
def global_kernel(ids, P, E, M, a, A, allc, activate, nrep, slots, multi, E2, direct,
                  replica_rank, S, slot_expert, slot_rank, R, rank_cost, cum, out,
                  E_PAD: tl.constexpr, E2_PAD: tl.constexpr, M_PAD: tl.constexpr,
                  S_PAD: tl.constexpr, R_PAD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """``allc [A, E]``: every attention rank's counts (rank ``a``'s row is this rank's)."""
    # each rank's cost under even splits: sum over its slots of share + activate * (share > 0)
    ss = tl.arange(0, S_PAD)
    sm = ss < S
    se = tl.load(slot_expert + ss, mask=sm, other=0)
    tot = tl.zeros([S_PAD], dtype=tl.int64)
    for r in range(0, A):
        tot += tl.load(allc + r * E + se, mask=sm, other=0)
    share = tot // tl.load(nrep + se, mask=sm, other=1)
    own_s = tl.where(sm, share + activate * (share > 0).to(tl.int64), 0)
    rr = tl.arange(0, R_PAD)
    srank = tl.load(slot_rank + ss, mask=sm, other=-1)
    per_rank = tl.sum(tl.where(srank[None, :] == rr[:, None], own_s[None, :], 0), axis=1)
    tl.store(rank_cost + rr, per_rank, mask=rr < R)
    tl.debug_barrier()
    # the water-filling of the multi experts, one [E2, M] tile
    qq = tl.arange(0, E2_PAD)
    jj = tl.arange(0, M_PAD)
    qm = qq < E2
    e = tl.load(multi + qq, mask=qm, other=0)
    n = tl.zeros([E2_PAD], dtype=tl.int64)
    hi = tl.zeros([E2_PAD], dtype=tl.int64)
    for r in range(0, A):
        x = tl.load(allc + r * E + e, mask=qm, other=0)
        n += x
        hi += tl.where(r <= a, x, 0)
    lo = hi - tl.load(allc + a * E + e, mask=qm, other=0)
    m_rep = tl.load(nrep + e, mask=qm, other=1)
    sh = n // m_rep
    own = sh + activate * (sh > 0).to(tl.int64)
    real = (jj[None, :] < m_rep[:, None]) & qm[:, None]
    rk = tl.load(replica_rank + e[:, None] * M + jj[None, :], mask=real, other=0)
    c = tl.where(real, tl.load(rank_cost + rk, mask=real, other=0) - own[:, None], _BIG)
    key = tl.sort(c * M_PAD + jj[None, :], dim=1)  # stable: cheapest replica first
    cs = key // M_PAD
    idx = key % M_PAD
    t = tl.cumsum(cs, axis=1) + n[:, None]  # c_0 + .. + c_i + pairs
    cnt = jj[None, :].to(tl.int64) + 1
    level = t // cnt
    used = tl.argmin(level, axis=1)  # first minimum
    lvl = tl.min(level, axis=1)[:, None]
    t_used = tl.sum(tl.where(jj[None, :] == used[:, None], t, 0), axis=1)[:, None]
    rem = t_used % (used[:, None].to(tl.int64) + 1)
    left = t - cnt * lvl - tl.minimum(cnt, rem)
    # the same at i - 1 (its previous end), +inf before the first
    left_prev = t - cs - (cnt - 1) * lvl - tl.minimum(cnt - 1, rem)
    left_prev = tl.where(jj[None, :] == 0, _INF, left_prev)
    lo2, hi2 = lo[:, None], hi[:, None]
    ends = tl.minimum(tl.maximum(n[:, None] - tl.associative_scan(left, 1, _min), lo2), hi2)
    prev = tl.minimum(tl.maximum(n[:, None] - tl.associative_scan(left_prev, 1, _min), lo2), hi2)
    back = tl.sort(idx * (1 << 40) + (ends - prev), dim=1)  # the quotas in replica order
    take = back % (1 << 40)
    tl.store(cum + qq[:, None] * M_PAD + jj[None, :], tl.cumsum(take, axis=1), mask=qm[:, None])
    tl.debug_barrier()
    _deal(ids, P, E, M, slots, direct, allc + a * E, cum, out, E_PAD, M_PAD, BLOCK)


class Layer:
    """One MoE layer's replica choice in Triton, identical to `splitmoe.eplb.policy.assign`
    (the same interface as `splitmoe.kernels.balance_cpu.Layer`).

    Built from its `ReplicaTable` (on the device), this attention rank's static slot per expert
    ``static_slot [E]``, the layer's ``slot_expert [S]`` and ``slot_rank [S]``, and ``load [E]``
    int64 on the device, the load counts every call adds this call's pairs to. ``ids`` are
    ``topk_ids [T, k]``; results are new ``[T, k]`` int64 tensors of slot ids.
    """

    def __init__(self, table, static_slot, slot_expert, slot_rank, load: torch.Tensor):
        dev = table.replica_slots.device
        self.load = load
        self.nrep = table.num_replicas.contiguous()
        self.slots = table.replica_slots.contiguous()
        self.E, self.M = self.slots.shape
        self.multi = table.multi.reshape(-1).contiguous()
        self.E2 = self.multi.numel()
        self.replica_rank = table.replica_rank.contiguous()
        self.R = table.num_ranks
        self.static_slot = static_slot.to(dev, torch.int64).contiguous()
        self.slot_expert = slot_expert.to(dev, torch.int64).contiguous()
        self.slot_rank = slot_rank.to(dev, torch.int64).contiguous()
        self.S = self.slot_expert.numel()
        # [E] a single-replica expert's slot, else -1 - its row among the multi experts
        direct = self.slots[:, 0].clone()
        direct[self.multi] = -1 - torch.arange(self.E2, device=dev)
        self.direct = direct
        self.E_PAD, self.M_PAD = next_pow2(self.E), next_pow2(self.M)
        if self.M_PAD > 4096:  # the sort keys `cost * M_PAD + j` stay within int64
            raise ValueError(
                f"the Triton balancer supports <= 4096 replicas per expert, not {self.M}"
            )
        self.E2_PAD, self.S_PAD = next_pow2(self.E2), next_pow2(self.S)
        self.R_PAD = next_pow2(self.R)
        # scratch: the cumulative quotas [E2, M_PAD], each rank's cost [R]
        self.cum = torch.zeros(max(1, self.E2) * self.M_PAD, dtype=torch.int64, device=dev)
        self.rank_cost = torch.zeros(self.R, dtype=torch.int64, device=dev)

    def static(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.contiguous()
        out = torch.empty(ids.shape, dtype=torch.int64, device=ids.device)
        P = ids.numel()
        static_kernel[(triton.cdiv(max(P, 1), 256),)](
            ids, P, self.E, self.static_slot, out, self.load, BLOCK=256
        )
        return out

    def count(self, ids: torch.Tensor, counts: torch.Tensor) -> None:
        """``counts [E]`` (int64) = this call's pairs per expert; load += counts."""
        ids = ids.contiguous()
        count_kernel[(1,)](ids, ids.numel(), self.E, counts, self.load, E_PAD=self.E_PAD,
                           BLOCK=BLOCK)  # fmt: skip

    def local(self, ids: torch.Tensor, attention_rank: int, counts: torch.Tensor) -> torch.Tensor:
        """``counts [E]``: scratch for this call's pairs per expert (`count`)."""
        ids = ids.contiguous()
        out = torch.empty(ids.shape, dtype=torch.int64, device=ids.device)
        local_kernel[(1,)](
            ids, ids.numel(), self.E, self.M, attention_rank, self.nrep, self.slots, self.multi,
            self.E2, self.direct, counts, self.load, self.cum, out, E_PAD=self.E_PAD,
            E2_PAD=self.E2_PAD, M_PAD=self.M_PAD, BLOCK=BLOCK,
        )  # fmt: skip
        return out

    def global_(self, ids: torch.Tensor, attention_rank: int, all_counts: torch.Tensor,
                counts: torch.Tensor, activate: int) -> torch.Tensor:  # fmt: skip
        """After `count` and the all-gather: ``all_counts [A, E]`` int64 on the device, every
        attention rank's counts in rank order (this rank's row is read, ``counts`` is not)."""
        ids = ids.contiguous()
        all_counts = all_counts.contiguous()
        out = torch.empty(ids.shape, dtype=torch.int64, device=ids.device)
        global_kernel[(1,)](
            ids, ids.numel(), self.E, self.M, attention_rank, all_counts.shape[0], all_counts,
            activate, self.nrep, self.slots, self.multi, self.E2, self.direct, self.replica_rank,
            self.S, self.slot_expert, self.slot_rank, self.R, self.rank_cost, self.cum, out,
            E_PAD=self.E_PAD, E2_PAD=self.E2_PAD, M_PAD=self.M_PAD, S_PAD=self.S_PAD,
            R_PAD=self.R_PAD, BLOCK=BLOCK,
        )  # fmt: skip
        return out
