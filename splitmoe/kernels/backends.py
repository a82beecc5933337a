"""The kernels a rank computes with, as backend objects chosen once at start-up.

The model's forward and the expert worker call one `AttentionBackend` and one `MoeBackend`; which
kernels sit behind them is decided here, from ``attention_backend`` / ``moe_backend`` and the
device, before the first step (as mini-sglang's ``BaseAttnBackend`` / ``BaseMoeBackend``):

* ``"torch"``: the PyTorch paths (`paged_attention_ref`, `fused_moe_torch`: on CPU the grouped
  GEMMs of `fused_moe_cpu`), on any device; the default on CPU.
* ``"triton"``: the Triton kernels (`paged_attention_triton`, `fused_moe_gpu`); the default on
  CUDA, and on CPU only through the Triton interpreter (tests).

A backend binds the kernel functions of its name (`ATTENTION_KERNELS`, `MOE_KERNELS`): no layer
loop, no communication, no request state, and no choice left for the hot path to make.

An attention rank's per-step replica choice (`splitmoe.eplb.Balancer`) binds a `BalancerBackend`
the same way: the native C kernel on CPU ranks, the Triton kernels on CUDA ranks, or the
PyTorch reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from splitmoe.kernels import balance_cpu
from splitmoe.kernels.fused_moe import MOE_KERNELS
from splitmoe.kernels.mla_attention import MLA_KERNELS, store_latent
from splitmoe.kernels.paged_attention import ATTENTION_KERNELS, store_kv
from splitmoe.kernels.triton_utils import require_triton

logger = logging.getLogger("splitmoe")


@dataclass(frozen=True)
class AttentionBackend:
    """Paged attention of one rank.

    attend: ``(q [T, num_heads, head_dim], k_cache, v_cache [blocks, block_size, num_kv_heads,
        head_dim], meta, scale) -> [T, num_heads, head_dim]``, causal over the cache;
    store_kv: ``(k, v [T, num_kv_heads, head_dim], k_cache, v_cache, slots [T])``, writes the
        new keys and values into their flat cache slots.
    attend_mla: multi-head latent attention (`splitmoe.kernels.mla_attention`): ``(q [T,
        num_heads, Dk] absorbed queries, cache [blocks, block_size, 1, Dk], meta, scale, v_dim)
        -> [T, num_heads, v_dim]``, causal over the latent cache;
    store_latent: ``(latent [T, Dk], cache, slots [T])``.
    """

    name: str
    attend: Callable[..., torch.Tensor]
    store_kv: Callable[..., None] = store_kv
    attend_mla: Callable[..., torch.Tensor] | None = None
    store_latent: Callable[..., None] = store_latent


@dataclass(frozen=True)
class MoeBackend:
    """The grouped expert FFN of one rank.

    experts: ``(x [N, H], w13 [E, 2I, H], w2 [E, H, I], expert_ids [N, k] local ids (-1: not
        here), weights [N, k]) -> [N, H]``, the weighted expert sums.
    """

    name: str
    experts: Callable[..., torch.Tensor]


def resolve_backend(name: str, device_type: str) -> str:
    """``"auto"``: Triton on CUDA, PyTorch elsewhere (the fastest on each, docs/kernels.md)."""
    if name == "auto":
        return "triton" if device_type == "cuda" else "torch"
    return name


def attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The attention backend ``name`` (``"auto"`` resolved) on ``device``."""
    name = resolve_backend(name, device.type)
    if name == "triton":
        require_triton("attention_backend", device)
    return AttentionBackend(name, ATTENTION_KERNELS[name], attend_mla=MLA_KERNELS[name])


def moe_backend(name: str, device: torch.device) -> MoeBackend:
    """The MoE backend ``name`` (``"auto"`` resolved) on ``device``."""
    name = resolve_backend(name, device.type)
    if name == "triton":
        require_triton("moe_backend", device)
    return MoeBackend(name, MOE_KERNELS[name])


# Which code makes the balancer's decision: "auto" is the native CPU kernel on CPU ranks, the
# Triton kernels on CUDA ranks; "torch" is the reference everywhere (tests, benchmarks).
BALANCER_KERNELS = ("auto", "native", "triton", "torch")


@dataclass(frozen=True)
class BalancerBackend:
    """The kernels behind one attention rank's per-step replica choice.

    name: ``"native"`` (`balance_cpu`, CPU ranks), ``"triton"`` (`balance_triton`, CUDA ranks)
        or ``"torch"`` (the PyTorch reference, `splitmoe.eplb.policy`, any device);
    layer: builds one MoE layer's kernel, ``(table, static_slot [E], slot_expert [S],
        slot_rank [S], load [E]) -> Layer`` with ``static(ids)``, ``count(ids, counts)``,
        ``local(ids, a, counts)`` and ``global_(ids, a, all_counts, counts, activate)``
        (`balance_cpu.Layer`, `balance_triton.Layer`); None for ``"torch"``, whose tensor
        code the balancer runs itself.
    """

    name: str
    layer: Callable[..., Any] | None


def balancer_backend(name: str, device: torch.device) -> BalancerBackend:
    """The balancer backend ``name`` (one of `BALANCER_KERNELS`) on ``device``.

    ``"auto"``: ``"native"`` on a CPU device when the C kernel builds, else ``"torch"`` (on a CPU
    without a C compiler with one warning naming the cause: the decision is the same, only
    slower); ``"triton"`` on CUDA when triton is installed, else ``"torch"``. ``"native"`` off
    the CPU, or without a compiler, is an error; so is ``"triton"`` without triton or (outside
    ``TRITON_INTERPRET=1``) off CUDA."""
    if name not in BALANCER_KERNELS:
        raise ValueError(f"balancer kernel={name!r} must be one of {BALANCER_KERNELS}")
    name = _resolve_balancer(name, device)
    if name == "triton":
        from splitmoe.kernels import balance_triton  # imports triton: only where it runs

        return BalancerBackend(name, balance_triton.Layer)
    return BalancerBackend(name, balance_cpu.Layer if name == "native" else None)


def _resolve_balancer(name: str, device: torch.device) -> str:
    if name == "triton":
        require_triton("balancer kernel", device)
        return "triton"
    if name == "auto" and device.type == "cuda":
        try:
            require_triton("balancer kernel", device)
        except RuntimeError:
            return "torch"
        return "triton"
    if name == "torch" or (name == "auto" and device.type != "cpu"):
        return "torch"
    if device.type != "cpu":
        raise ValueError(f"balancer kernel='native' runs on CPU ranks, not on {device}")
    try:
        balance_cpu.library()
    except balance_cpu.NativeUnavailable as e:
        if name == "native":
            raise
        if not _warned[0]:
            logger.warning("%s; the balancer falls back to its (slower) PyTorch reference", e)
            _warned[0] = True
        return "torch"
    return "native"


_warned = [False]  # the missing-compiler warning, once per process
