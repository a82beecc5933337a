"""The balancer's native CPU kernel (`balance_cpu.c`): one call per layer and policy.

`Layer` is the whole interface: one MoE layer's tables as the C code reads them, and one method
per call (``static``, ``count``, ``local``, ``global_``), each one ctypes call on addresses taken
when the layer was built. ctypes stays inside this module.

The C source is compiled on first use (~0.2 s) and loaded with ctypes (`native.build`). The
kernel reads the
tensors' memory in place (``data_ptr``), so a call costs the ctypes round trip (~1 us) plus
its loops; the PyTorch code in `splitmoe.eplb.policy` stays the reference it is tested against.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from splitmoe.kernels import native
from splitmoe.kernels.native import NativeUnavailable  # noqa: F401  (what `build` raises)

SOURCE = Path(__file__).with_name("balance_cpu.c")
_FLAGS = ["-O3", "-std=c11", "-shared", "-fPIC"]
_ERRORS = {
    -1: "an expert id outside [0, num_experts)",
    -2: "counts that disagree with topk_ids",
    -3: "out of memory",
}


class _Table(ctypes.Structure):
    """One layer's `table_t` (see the C source); keeps the tensors it points into alive."""

    _fields_ = [
        ("E", ctypes.c_int64),
        ("M", ctypes.c_int64),
        ("R", ctypes.c_int64),
        ("E2", ctypes.c_int64),
        ("nrep", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("static_slot", ctypes.c_void_p),
        ("multi", ctypes.c_void_p),
        ("replica_rank", ctypes.c_void_p),
        ("S", ctypes.c_int64),
        ("slot_expert", ctypes.c_void_p),
        ("slot_rank", ctypes.c_void_p),
        ("direct", ctypes.c_void_p),
    ]

    @classmethod
    def build(cls, table, static_slot: torch.Tensor, slot_expert: torch.Tensor,
              slot_rank: torch.Tensor) -> _Table:  # fmt: skip
        """From a `ReplicaTable` (CPU), this rank's static slot per expert ``[E]`` and the
        layer's ``slot_expert [S]`` / ``slot_rank [S]``."""
        keep = [
            t.to(torch.int64).contiguous()
            for t in (
                table.num_replicas,
                table.replica_slots,
                static_slot,
                table.multi.reshape(-1),
                table.replica_rank,
                slot_expert,
                slot_rank,
            )
        ]
        nrep, slots, static, multi, rank, expert, srank = keep
        direct = slots[:, 0].clone()  # [E] single-replica experts' slot, else -1 - row
        direct[multi] = -1 - torch.arange(multi.numel())
        keep.append(direct)
        out = cls(
            E=slots.shape[0],
            M=slots.shape[1],
            R=table.num_ranks,
            E2=multi.numel(),
            nrep=nrep.data_ptr(),
            slots=slots.data_ptr(),
            static_slot=static.data_ptr(),
            multi=multi.data_ptr(),
            replica_rank=rank.data_ptr(),
            S=expert.numel(),
            slot_expert=expert.data_ptr(),
            slot_rank=srank.data_ptr(),
            direct=direct.data_ptr(),
        )
        out._keep = keep
        return out


def build(cache_dir: Path | None = None) -> Path:
    """The compiled library's path, building it if this source and compiler have none yet."""
    return native.build(SOURCE, _FLAGS, "the balancer's native CPU kernel", cache=cache_dir)


_LIB: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The loaded kernel (built on first use); raises `NativeUnavailable`."""
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL(str(build()))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        tab = p  # the table's address (ctypes.addressof): an int converts fastest
        for name, args in {
            "smb_static": [tab, p, i64, p, p],
            "smb_count": [p, i64, i64, p, p],
            "smb_local": [tab, p, i64, i64, p, p],
            "smb_global": [tab, p, i64, i64, i64, p, p, i64, p],
        }.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
        _LIB = lib
    return _LIB


def check(rc: int) -> None:
    if rc:
        raise ValueError(f"balancer: {_ERRORS.get(rc, f'error {rc}')} (native kernel)")


class Layer:
    """One MoE layer's replica choice in C, identical to `splitmoe.eplb.policy.assign`.

    Built (once per placement change of the layer) from its `ReplicaTable`, this attention
    rank's static slot per expert ``static_slot [E]``, the layer's ``slot_expert [S]`` and
    ``slot_rank [S]``, and ``load [E]`` int64 (contiguous, CPU), the load counts every call adds
    this call's pairs to. ``ids`` are ``topk_ids [T, k]`` (any integer dtype; ids outside
    ``[0, E)`` raise ``ValueError``); results are new ``[T, k]`` int64 tensors of slot ids.
    """

    def __init__(self, table, static_slot: torch.Tensor, slot_expert: torch.Tensor,
                 slot_rank: torch.Tensor, load: torch.Tensor):  # fmt: skip
        if load.dtype is not torch.int64 or not load.is_contiguous() or load.device.type != "cpu":
            raise ValueError("the native balancer adds into a contiguous int64 CPU load row")
        lib = library()
        self._table = _Table.build(table, static_slot, slot_expert, slot_rank)
        self._load = load  # kept alive: the C code adds into its memory
        # the call's constant arguments, taken once (an int converts fastest through ctypes)
        self._at, self._load_at = ctypes.addressof(self._table), load.data_ptr()
        self._E = self._table.E
        self._static, self._count = lib.smb_static, lib.smb_count
        self._local, self._global = lib.smb_local, lib.smb_global

    # (each method: one C call; ``if rc`` before `check` saves a Python call on the way)

    def static(self, ids: torch.Tensor) -> torch.Tensor:
        ids = _int64(ids)
        out = torch.empty_like(ids)
        rc = self._static(self._at, ids.data_ptr(), ids.numel(), out.data_ptr(), self._load_at)
        if rc:
            check(rc)
        return out

    def count(self, ids: torch.Tensor, counts: torch.Tensor) -> None:
        """``counts [E]`` (int64, contiguous) = this call's pairs per expert; load += counts."""
        ids = _int64(ids)
        rc = self._count(ids.data_ptr(), ids.numel(), self._E, counts.data_ptr(), self._load_at)
        if rc:
            check(rc)

    def local(self, ids: torch.Tensor, attention_rank: int, counts: torch.Tensor) -> torch.Tensor:
        """``counts [E]``: scratch for this call's pairs per expert (`count`)."""
        ids = _int64(ids)
        P, at, c = ids.numel(), ids.data_ptr(), counts.data_ptr()
        out = torch.empty_like(ids)
        rc = self._count(at, P, self._E, c, self._load_at) or self._local(
            self._at, at, P, attention_rank, c, out.data_ptr()
        )
        if rc:
            check(rc)
        return out

    def global_(self, ids: torch.Tensor, attention_rank: int, all_counts: torch.Tensor,
                counts: torch.Tensor, activate: int) -> torch.Tensor:  # fmt: skip
        """After `count` (``counts``) and the all-gather: ``all_counts [A, E]`` int64 contiguous
        CPU, every attention rank's ``counts`` in rank order."""
        ids = _int64(ids)
        out = torch.empty_like(ids)
        rc = self._global(
            self._at, ids.data_ptr(), ids.numel(), attention_rank, all_counts.shape[0],
            all_counts.data_ptr(), counts.data_ptr(), activate, out.data_ptr(),
        )  # fmt: skip
        if rc:
            check(rc)
        return out


def _int64(ids: torch.Tensor) -> torch.Tensor:
    if ids.dtype is not torch.int64:
        ids = ids.long()
    return ids if ids.is_contiguous() else ids.contiguous()
