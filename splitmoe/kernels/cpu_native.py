"""Native CPU kernels (the ``"cpu"`` backend), float32. For ``attention_backend``: decode
attention over the paged KV cache, RMSNorm, the q/k head norm fused with RoPE, the router's
top-k, the KV store, and the dispatch rows (`route_pack`); for ``moe_backend``: the routed
experts of a MoE layer (`fused_moe`).

On CPU an attention rank's decode layer costs per-op overheads, not arithmetic: the reference
gathers every sequence's K/V blocks into a padded copy and runs SDPA as per-(sequence, head)
GEMMs of a few rows, an RMSNorm is six small ops, and the grouped expert FFN is a sort, gathers,
two grouped GEMMs that loop over experts, and a scatter. ``csrc/cpu_kernels.c`` does each in one
pass over its data. It is plain C, built on first use with the system C compiler
(``cc -O3 -march=native``, well under a second) into a cache directory and loaded with ctypes;
without a compiler `available` is False and ``"auto"`` stays on the PyTorch paths. The decode
layer and the fused MoE split their rows over `set_threads` threads (bit-identical results); the
other kernels are single-threaded. The wrappers check what the C code assumes (dtypes, devices,
strides) and raise ``ValueError`` naming the problem. The PyTorch references are the oracle in
tests (tests/kernels/test_cpu_native.py); docs/kernels.md has the figures.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from splitmoe import host_memory
from splitmoe.kernels.paged_attention import AttentionMetadata, _derived

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
FLAGS = (
    "-O3",
    "-march=native",
    "-std=c11",
    "-ffp-contract=fast",  # FMAs (ISO C mode would turn contraction off)
    "-fPIC",
    "-pthread",
    "-shared",
    "-Werror=implicit-function-declaration",
)
MAX_HEAD_DIM = 1024  # the fused norm + RoPE kernel keeps one head in a stack buffer

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
MAX_TOP_K = 64  # experts per token the fused MoE and the decode step take (their C limit)
_SIGNATURES = {
    "splitmoe_decode_attention_f32": (
        ctypes.c_int,
        [_p, _i64, _i64, _p, _p, _p, _i64, _i64, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _i64]
        + [_f32, _p, _i64, _i64],
    ),
    "splitmoe_rms_norm_f32": (
        None,
        [_p, _i64, _i64, _i64, _i64, _i64, _p, _i64, _f32, _p, _i64, _i64],
    ),
    "splitmoe_norm_rope_f32": (
        ctypes.c_int,
        [_p, _i64, _i64, _i64, _i64, _i64, _p, _i64, _f32, _p, _p, _i64],
    ),
    "splitmoe_route_f32": (ctypes.c_int, [_p, _i64, _i64, _i64, ctypes.c_int, _p, _p]),
    "splitmoe_store_kv_f32": (ctypes.c_int, [_p, _i64, _p, _i64, _p, _p, _p, _i64, _i64, _i64]),
    "splitmoe_route_pack": (
        ctypes.c_int64,
        [_p, _i64, _i64, _p, _p, _i64, _i64, _p, _i64, _p, _p, _p, _p],
    ),
    "splitmoe_fused_moe_f32": (
        ctypes.c_int,
        [_p, _i64, _i64, _i64, _p, _p, _i64, _i64, _p, _p, _i64, _p],
    ),
    "splitmoe_fused_moe_rows_f32": (ctypes.c_int, [_p, _i64, _i64, _p, _p, _i64, _i64, _i64, _p]),
    "splitmoe_ring_send": (ctypes.c_int, [_p, _i64, _p, _i64]),
    "splitmoe_ring_peek": (ctypes.c_int64, [_p, _i64, _i64]),
    "splitmoe_ring_recv": (ctypes.c_int64, [_p, _i64, _p, _i64, _i64]),
    "splitmoe_dispatch_send": (
        ctypes.c_int64,
        [_p, _i64, _i64, _p, _i64, _p, _p, _p, _i64, _i64, _p, _i64, _p, _p, _p, _p, _p, _i64, _p],
    ),
    "splitmoe_set_threads": (ctypes.c_int, [ctypes.c_int]),
    "splitmoe_decode_layer_f32": (
        ctypes.c_int,
        [_p, _i64, _i64, _p, _p, _f32, _p, _p, _p, _p, _p, _i64, _p, _p, _i64, _i64, _p, _i64]
        + [_i64, _p, _p, _i64, _i64, _i64, _f32, _p, _p, _i64, _i64, ctypes.c_int, _p, _p, _p],
    ),
    "splitmoe_lm_head_f32": (None, [_p, _i64, _i64, _p, _i64, _p]),
    "splitmoe_remote_layer": (ctypes.c_int64, [_p, _i64]),
    "splitmoe_expert_layer": (ctypes.c_int64, [_p, _i64]),
    "splitmoe_remote_struct_bytes": (ctypes.c_int64, [_i64]),
    "splitmoe_decode_step_f32": (
        ctypes.c_int,
        [_p, _i64, _p, _i64, _i64, _p, _i64, _f32, _p, _p, _i64, _p, _i64, _i64, _i64, _i64, _p]
        + [_i64, _i64, _p, _p, _i64, _i64, _i64, _f32, _i64, _i64, ctypes.c_int, _i64, _p, _p, _p],
    ),
}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "splitmoe" / "cpu-kernels"


def _compiler() -> str | None:
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _host_key() -> str:
    """What a ``-march=native`` binary depends on besides the source: the CPU's features."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + flags


def build(directory: Path | None = None) -> Path:
    """Compiles ``csrc/cpu_kernels.c`` (once per source, flags and CPU) and returns the shared
    library's path. Raises RuntimeError if there is no C compiler or the build fails."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError(
            "no C compiler (cc, gcc or clang) on PATH to build splitmoe's CPU kernels; install "
            "one (e.g. apt install gcc) or use attention_backend='torch' and moe_backend='torch'"
        )
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join((cc, *FLAGS, _host_key())).encode()).hexdigest()[:16]
    directory = directory or cache_dir()
    lib = directory / f"cpu_kernels-{key}.so"
    if lib.is_file():
        return lib
    directory.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name and rename: ranks that build at once never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"building splitmoe's CPU kernels failed ({cc} {' '.join(FLAGS)}):\n"
                f"{result.stderr.strip()}\nuse attention_backend='torch' and moe_backend='torch' "
                "to run without them"
            )
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded kernels (built first if needed); RuntimeError if they cannot be built."""
    lib = ctypes.CDLL(str(build()))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    lib.splitmoe_set_threads(_threads)
    return lib


_threads = 1


def threads() -> int:
    """The threads the parallel kernels use (`set_threads`)."""
    return _threads


def set_threads(n: int) -> int:
    """The threads the decode layer and the fused MoE split their work over (the calling thread
    and n - 1 of the library's own; the results are bit-identical for every n). A rank on these
    kernels gives them its threads (`runtime.set_threads`). Applied now if the kernels are
    loaded, else when they are; returns the count asked for. Not while a kernel runs."""
    global _threads
    _threads = max(1, int(n))
    if library.cache_info().currsize:
        library().splitmoe_set_threads(_threads)
    return _threads


@functools.cache
def available() -> bool:
    """Whether the kernels build and load here (x86-64 or arm64 Linux/macOS with a C compiler)."""
    try:
        library()
    except (RuntimeError, OSError) as e:
        logger.warning("native CPU kernels unavailable, staying on the PyTorch paths: %s", e)
        return False
    return True


def _check_f32(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.float32 or not t.is_cpu or t.stride(-1) != 1:
        raise ValueError(
            f"cpu kernels: {name} must be a float32 CPU tensor with a contiguous last dim; got "
            f"{t.dtype} on {t.device} with strides {t.stride()}"
        )


def _decode_rows(
    meta: AttentionMetadata,
) -> tuple[torch.Tensor | None, torch.Tensor | None, int, torch.Tensor]:
    """``(seq_index, rows, count, seq_lens)`` of the step's one-token sequences, built once per
    step: their indices in the step and their query rows (None, None for a pure decode step,
    where both are the identity), and the step's ``seq_lens`` as int64."""

    def build(m: AttentionMetadata):
        lens = m.seq_lens.to(torch.int64).contiguous()
        decode = [i for i, n in enumerate(m.query_lens) if n == 1]
        if len(decode) == len(m.query_lens) or not decode:
            return None, None, len(decode), lens
        idx = torch.tensor(decode, dtype=torch.int64)
        return idx, m.query_start_loc.index_select(0, idx).to(torch.int64), len(decode), lens

    return _derived(meta, ("cpu-decode",), build)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> int:
    """Writes the attention of the step's one-token rows into their rows of ``out``; returns
    how many sequences that was.

    q, out: ``[T, num_heads, head_dim]`` float32 (any row and head strides, head_dim
    contiguous); caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous. The same
    math as `paged_attention_ref` (softmax in float32), reading K/V through the block table."""
    seq_index, rows, count, lens = _decode_rows(meta)
    if count == 0:
        return 0
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_f32(name, t)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("cpu kernels: k_cache and v_cache must be contiguous")
    tables = meta.block_tables
    if tables.dtype != torch.int32 or (tables.numel() and tables.stride(1) != 1):
        raise ValueError(
            f"cpu kernels: block_tables must be int32 with contiguous rows; got {tables.dtype} "
            f"strides {tables.stride()}"
        )
    nb, bs, nkv, d = k_cache.shape
    nh = q.shape[1]
    rc = library().splitmoe_decode_attention_f32(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        tables.shape[1],
        nb,
        lens.data_ptr(),
        None if seq_index is None else seq_index.data_ptr(),
        None if rows is None else rows.data_ptr(),
        count,
        nh,
        nkv,
        d,
        bs,
        scale,
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
    )
    if rc == -3:
        raise ValueError(
            f"cpu kernels: decode attention: a sequence is longer than its block table row "
            f"({tables.shape[1]} blocks of {bs}) or a block id is outside 0..{nb - 1}"
        )
    if rc != 0:
        raise MemoryError("cpu kernels: decode attention could not allocate its scores")
    return count


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x [T, H]`` float32 (weight ``[H]`` or None)."""
    _check_f32("x", x)
    if x.dim() != 2 or x.stride(0) < x.shape[1]:
        raise ValueError(f"cpu kernels: rms_norm takes [T, H] rows; got {tuple(x.shape)}")
    if weight is not None:
        _check_f32("weight", weight)
        if weight.shape != x.shape[-1:]:
            raise ValueError(f"cpu kernels: weight {tuple(weight.shape)} for x {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype)
    T, H = x.shape
    library().splitmoe_rms_norm_f32(
        x.data_ptr(),
        x.stride(0),
        0,
        T,
        1,
        H,
        None if weight is None else weight.data_ptr(),
        0,
        eps,
        out.data_ptr(),
        H,
        0,
    )
    return out


def lm_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits ``[T, V]`` float32 of ``x [T, H]`` times an LM head ``weight [V, H]`` (as stored)
    transposed: ``F.linear`` to rounding, on the kernels' threads (bit-identical for every
    thread count). At decode batch sizes ~2-4x faster than MKL on one thread (CPU)."""
    for name, t in (("x", x), ("weight", weight)):
        _check_f32(name, t)
        if t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"cpu kernels: lm_head {name} must be a contiguous matrix")
    T, H = x.shape
    if weight.shape[1] != H:
        raise ValueError(
            f"cpu kernels: lm_head weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}"
        )
    logits = torch.empty(T, weight.shape[0], dtype=torch.float32)
    if T:
        library().splitmoe_lm_head_f32(
            x.data_ptr(), T, H, weight.data_ptr(), weight.shape[0], logits.data_ptr()
        )
    return logits


def norm_rope_(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """In place on ``x [T, heads, d]`` float32 (head_dim contiguous): RMSNorm of every head with
    per-head weights ``[heads, d]`` (None: no norm), then rotary embedding with ``cos, sin
    [T, 1, d]`` as built by `AttentionModel.rope` (sin's first half negated). Returns ``x``."""
    _check_f32("x", x)
    T, heads, d = x.shape
    if d % 2 or d > MAX_HEAD_DIM:
        raise ValueError(f"cpu kernels: head_dim {d} must be even and at most {MAX_HEAD_DIM}")
    for name, t in (("cos", cos), ("sin", sin)):
        _check_f32(name, t)
        if t.shape != (T, 1, d) or t.stride() != cos.stride():
            raise ValueError(f"cpu kernels: {name} must be [{T}, 1, {d}]; got {tuple(t.shape)}")
    if weight is not None:
        _check_f32("weight", weight)
        if weight.shape != (heads, d):
            raise ValueError(f"cpu kernels: weight {tuple(weight.shape)} for {heads} heads of {d}")
    library().splitmoe_norm_rope_f32(
        x.data_ptr(),
        x.stride(0),
        x.stride(1),
        T,
        heads,
        d,
        None if weight is None else weight.data_ptr(),
        0 if weight is None else weight.stride(0),
        eps,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
    )
    return x


def route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of router ``logits [T, E]`` float32: ``ids [T, k]`` int64 (descending) and
    their softmax probabilities ``[T, k]`` float32 (over all E; renormalised to sum to 1 when
    ``renormalize``), as `AttentionModel.route` computes them with torch ops."""
    _check_f32("logits", logits)
    if logits.dim() != 2 or not logits.is_contiguous() or not 1 <= k <= logits.shape[1] <= 4096:
        raise ValueError(
            f"cpu kernels: route takes contiguous [T, E] logits with 1 <= k <= E <= 4096; got "
            f"{tuple(logits.shape)}, k {k}"
        )
    T, E = logits.shape
    ids = torch.empty(T, k, dtype=torch.int64)
    weights = torch.empty(T, k, dtype=torch.float32)
    library().splitmoe_route_f32(
        logits.data_ptr(), T, E, k, int(renormalize), ids.data_ptr(), weights.data_ptr()
    )
    return ids, weights


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """`paged_attention.store_kv` for float32: ``k, v [T, num_kv_heads, head_dim]`` (each
    token's heads contiguous, any token stride) into the caches' ``slots [T]`` int64."""
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_f32(name, t)
    nkv, d = k_cache.shape[-2:]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("cpu kernels: k_cache and v_cache must be contiguous")
    T = k.shape[0]
    for name, t in (("k", k), ("v", v)):
        if t.shape != (T, nkv, d) or t.stride(1) != d:
            raise ValueError(
                f"cpu kernels: {name} must be [{T}, {nkv}, {d}] with each token's heads "
                f"contiguous; got {tuple(t.shape)} strides {t.stride()}"
            )
    if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape != (T,):
        raise ValueError(f"cpu kernels: slots must be contiguous int64 [{T}]")
    num_slots = k_cache.numel() // (nkv * d)
    rc = library().splitmoe_store_kv_f32(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        T,
        nkv * d,
        num_slots,
    )
    if rc != 0:
        raise ValueError(f"cpu kernels: store_kv got a slot outside 0..{num_slots - 1}")


def route_pack(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    slot_rank: torch.Tensor,
    slot_local: torch.Tensor,
    num_ranks: int,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """`Transport.route` and `Transport.pack` in one pass, the same bytes: ``x [T, H]`` (any
    dtype, contiguous), ``slots [T, k]`` (slot of each (token, expert)), router ``weights
    [T, k]``, ``slot_rank / slot_local [S]`` int64 (expert rank and local id of each slot).
    Returns ``token_index [P]`` int64, ``rows [P, H * elem + 8 k]`` uint8 grouped by destination
    and the row count per expert rank."""
    x, slots, w, rows, token_index = _pack_args("route_pack", x, slots, weights, num_ranks)
    T, k = slots.shape
    counts = torch.empty(num_ranks, dtype=torch.int64)
    P = library().splitmoe_route_pack(
        slots.data_ptr(),
        T,
        k,
        slot_rank.data_ptr(),
        slot_local.data_ptr(),
        slot_rank.numel(),
        num_ranks,
        x.data_ptr(),
        x.shape[1] * x.element_size(),
        w.data_ptr(),
        rows.data_ptr(),
        token_index.data_ptr(),
        counts.data_ptr(),
    )
    token_index, rows = _packed("route_pack", P, f"a slot outside 0..{slot_rank.numel() - 1}",
                                token_index, rows)  # fmt: skip
    return token_index, rows, counts.tolist()


def _pack_args(
    what: str, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_ranks: int
) -> tuple[torch.Tensor, ...]:
    """The inputs of `route_pack` and `DispatchSend` checked and made what the C calls read
    (contiguous ``x``, int64 ``ids``, float32 ``weights``; converted only where needed: ~1 us
    each on a path run per layer and micro-batch), then the rows and token indices they may
    write (``T * min(k, num_ranks)``)."""
    T, k = ids.shape
    if x.dim() != 2 or x.shape[0] != T or not x.is_cpu or weights.shape != (T, k):
        raise ValueError(
            f"cpu kernels: {what} takes CPU x [T, H] and ids / weights [T, k]; got x "
            f"{tuple(x.shape)} on {x.device}, ids {tuple(ids.shape)}, weights "
            f"{tuple(weights.shape)}"
        )
    if k > MAX_TOP_K:
        raise ValueError(f"cpu kernels: {what} takes top_k <= {MAX_TOP_K}, got {k}")
    x = x.contiguous()
    if ids.dtype != torch.int64 or not ids.is_contiguous():
        ids = ids.to(torch.int64).contiguous()
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.to(torch.float32).contiguous()
    cap = T * min(k, num_ranks)
    rows = torch.empty(cap, x.shape[1] * x.element_size() + 8 * k, dtype=torch.uint8)
    return x, ids, weights, rows, torch.empty(cap, dtype=torch.int64)


def _packed(
    what: str, P: int, bad: str, token_index: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``P`` token indices and rows `_pack_args` allocated, or the error of a C call
    that returned ``P < 0`` (``bad``: what it refuses besides a slot owned by no expert rank)."""
    if P == -2:
        raise MemoryError(f"cpu kernels: {what} could not allocate")
    if P < 0:
        raise ValueError(f"cpu kernels: {what} got {bad} or a slot owned by no expert rank")
    if P < rows.shape[0]:  # (P == the capacity with one expert rank: every token goes there)
        token_index, rows = token_index[:P], rows[:P]
    return token_index, rows


class DispatchSend:
    """An attention rank's dispatch of one MoE layer in one native call
    (`splitmoe_dispatch_send`) where the slot of each expert is fixed (the static balancer):
    each (token, expert) mapped to its slot, counted into the balancer's load, routed and packed
    as `route_pack` does (the same bytes), and each expert rank's rows sent as one frame on its
    shared-memory ring (`splitmoe.comm.shm`, the native ring send: the same framing).

    Built once per transport: ``slot_rank / slot_local [S]`` int64 as `route_pack` takes them,
    ``rings`` the base address of the ring towards each expert rank and ``capacity`` their data
    bytes."""

    def __init__(
        self, slot_rank: torch.Tensor, slot_local: torch.Tensor, rings: list[int], capacity: int
    ):
        self._keep = (slot_rank, slot_local)
        self.num_ranks = len(rings)
        self._rings = torch.tensor(rings, dtype=torch.int64)
        self._fixed = (slot_rank.data_ptr(), slot_local.data_ptr(), slot_rank.numel())
        self._ring_args = (self._rings.data_ptr(), capacity)

    def __call__(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        expert_slot: torch.Tensor | None,
        load: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """``x [T, H]`` on the CPU (any dtype), ``ids [T, k]`` expert ids and their router
        ``weights [T, k]``, ``expert_slot [E]`` int64 (None: slot = expert id, E the slots;
        contiguous, as ``load``), ``load [E]`` int64 counts to add to (None: not counted). Returns
        ``token_index [P]``, the rows ``[P, row_bytes]``, the row count per expert rank and the
        expert ranks whose frame did not fit its ring now (the caller sends those)."""
        R = self.num_ranks
        x, ids, weights, rows, token_index = _pack_args("dispatch_send", x, ids, weights, R)
        T, k = ids.shape
        # (unmapped, an expert id is its slot)
        E = self._fixed[2] if expert_slot is None else expert_slot.numel()
        out = torch.empty(2, R, dtype=torch.int64)  # row counts, then "sent" flags
        P = library().splitmoe_dispatch_send(
            ids.data_ptr(),
            T,
            k,
            None if expert_slot is None else expert_slot.data_ptr(),
            E,
            None if load is None else load.data_ptr(),
            *self._fixed,
            R,
            x.data_ptr(),
            x.shape[1] * x.element_size(),
            weights.data_ptr(),
            rows.data_ptr(),
            token_index.data_ptr(),
            out.data_ptr(),
            *self._ring_args,
            out.data_ptr() + 8 * R,
        )
        bad = f"an expert id outside 0..{E - 1}"
        token_index, rows = _packed("dispatch_send", P, bad, token_index, rows)
        counts, sent = out.tolist()
        return token_index, rows, counts, [r for r in range(R) if not sent[r]]


def expert_layout(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_moe`'s weight layout from the loader's ``w13 [E, 2I, H]``, ``w2 [E, H, I]``:
    ``w13t [E, H, 2I]``, ``w2t [E, I, H]`` (row-major GEMMs over the hidden and intermediate
    dims; converted once when the experts are loaded)."""
    return w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()


def fused_moe(
    x: torch.Tensor,
    w13t: torch.Tensor,
    w2t: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The routed-expert output ``[N, H]`` float32, as `fused_moe_ref`: ``x [N, H]`` (rows may
    lie apart, as a row-major view's do), weights in `expert_layout` (``w13t [E, H, 2I]`` gate
    columns then up, ``w2t [E, I, H]``), ``expert_ids [N, k]`` local ids (-1: served elsewhere)
    and router ``weights [N, k]``."""
    _check_f32("x", x)
    if x.dim() != 2:
        raise ValueError(f"cpu kernels: fused_moe takes x [N, H]; got {tuple(x.shape)}")
    N, H = x.shape
    E, I = _expert_weights(w13t, w2t, H, "x", x.shape)
    if expert_ids.shape != weights.shape or expert_ids.dim() != 2 or expert_ids.shape[0] != N:
        raise ValueError(
            f"cpu kernels: fused_moe routing expert_ids {tuple(expert_ids.shape)} and weights "
            f"{tuple(weights.shape)} must both be [{N}, k]"
        )
    out = torch.zeros(N, H, dtype=torch.float32)
    if N == 0:
        return out
    ids = expert_ids.to(torch.int64).contiguous()
    w = weights.to(torch.float32).contiguous()
    rc = library().splitmoe_fused_moe_f32(
        x.data_ptr(),
        x.stride(0),
        N,
        H,
        w13t.data_ptr(),
        w2t.data_ptr(),
        E,
        I,
        ids.data_ptr(),
        w.data_ptr(),
        ids.shape[1],
        out.data_ptr(),
    )
    _check_moe_rc(rc, E, ids.shape[1])
    return out


def fused_moe_rows(
    rows: torch.Tensor, top_k: int, w13t: torch.Tensor, w2t: torch.Tensor
) -> torch.Tensor:
    """`fused_moe` of a received message's packed rows ``[N, 4 H + 8 top_k]`` uint8 (float32
    ``x``, then int32 local expert ids, then float32 weights: `Transport.pack`), read in place
    rather than unpacked into three tensors first (~10 us a message)."""
    H = w13t.shape[1] if w13t.dim() == 3 else 0
    if (
        rows.dtype != torch.uint8
        or not rows.is_cpu
        or rows.dim() != 2
        or rows.shape[1] != 4 * H + 8 * top_k
        or not rows.is_contiguous()
        or rows.data_ptr() % 4
    ):
        raise ValueError(
            f"cpu kernels: fused_moe_rows takes contiguous, 4-byte aligned CPU uint8 rows "
            f"[N, {4 * H + 8 * top_k}]; got {rows.dtype} {tuple(rows.shape)} on {rows.device}"
        )
    E, I = _expert_weights(w13t, w2t, H, "rows", rows.shape)
    N = rows.shape[0]
    out = torch.zeros(N, H, dtype=torch.float32)
    if N == 0:
        return out
    rc = library().splitmoe_fused_moe_rows_f32(
        rows.data_ptr(), N, H, w13t.data_ptr(), w2t.data_ptr(), E, I, top_k, out.data_ptr()
    )
    _check_moe_rc(rc, E, top_k)
    return out


def _expert_weights(
    w13t: torch.Tensor, w2t: torch.Tensor, H: int, name: str, shape: torch.Size
) -> tuple[int, int]:
    """``(E, I)`` of contiguous float32 `expert_layout` weights for hidden size ``H``, or the
    ValueError of `fused_moe` and `fused_moe_rows` (``name``, ``shape``: their input, for the
    message, which is built only then: this runs per layer and micro-batch)."""
    _check_f32("w13t", w13t)
    _check_f32("w2t", w2t)
    E, H2, two_i = w13t.shape if w13t.dim() == 3 else (0, -1, 1)
    if H2 != H or two_i % 2 or w2t.shape != (E, two_i // 2, H):
        raise ValueError(
            f"cpu kernels: fused_moe shapes do not fit: {name} {tuple(shape)}, w13t "
            f"{tuple(w13t.shape)} and w2t {tuple(w2t.shape)} (want expert_layout's [E, {H}, 2I] "
            f"and [E, I, {H}])"
        )
    if not (w13t.is_contiguous() and w2t.is_contiguous()):
        raise ValueError("cpu kernels: fused_moe takes contiguous expert_layout weights")
    return E, two_i // 2


def _check_moe_rc(rc: int, E: int, k: int) -> None:
    if rc == -2:
        raise ValueError(f"cpu kernels: fused_moe got an expert id >= {E} (the experts held here)")
    if rc == -5:
        raise ValueError(
            f"cpu kernels: fused_moe takes up to {MAX_TOP_K} experts per token, got {k}; use "
            "moe_backend='torch'"
        )
    if rc != 0:
        raise MemoryError("cpu kernels: fused_moe could not allocate its scratch rows")


def _step_addresses(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(block_tables, seq_lens, slot_mapping)`` of a step as the native decode layer reads them
    (int32 rows, contiguous int64), checked once per step rather than in every layer."""

    def build(m: AttentionMetadata):
        tables = m.block_tables
        if tables.dtype != torch.int32 or (tables.numel() and tables.stride(1) != 1):
            raise ValueError("cpu kernels: block_tables must be int32 with contiguous rows")
        lens, slots = m.seq_lens.contiguous(), m.slot_mapping.contiguous()
        if lens.dtype != torch.int64 or slots.dtype != torch.int64:
            raise ValueError("cpu kernels: seq_lens and slot_mapping must be int64")
        return tables, lens, slots

    return _derived(meta, ("cpu-layer",), build)


def _cache_args(meta: AttentionMetadata, cache: torch.Tensor) -> tuple:
    """The paged-cache arguments of the decode layer and the decode step: blocks and block size
    of ``cache`` (``[.., blocks, block_size, nkv, d]``), then the step's block tables (address,
    row stride, width), sequence lengths and slots (kept alive by ``meta``)."""
    tables, lens, slots = _step_addresses(meta)
    nb, bs = cache.shape[-4:-2]
    return (nb, bs, tables.data_ptr(), tables.stride(0), tables.shape[1], lens.data_ptr(),
            slots.data_ptr())  # fmt: skip


def _raise_step_error(rc: int, what: str, cache: torch.Tensor) -> None:
    """The errors of the decode layer and the decode step (-3: bad cache addresses)."""
    if rc == -3:
        nb, bs = cache.shape[-4:-2]
        raise ValueError(
            f"cpu kernels: {what}: a sequence is longer than its block table row, or a block id "
            f"or slot is outside the cache ({nb} blocks of {bs})"
        )
    if rc != 0:
        raise MemoryError(f"cpu kernels: {what} could not allocate its scratch")


def _check_step_call(
    what: str, x: torch.Tensor, fits: bool, rows: str, meta: AttentionMetadata, f32: tuple
) -> None:
    """The call-time checks the decode layer and the decode step share: ``x`` (``fits``, as
    ``rows`` describes it) holds one token for each sequence of ``meta``, and the ``(name,
    tensor)`` pairs of ``f32`` are float32."""
    T = x.shape[0]
    if not fits or meta.num_seqs != T or meta.slot_mapping.shape != (T,):
        raise ValueError(
            f"cpu kernels: {what} takes {rows}; got {tuple(x.shape)} {x.dtype} for "
            f"{meta.num_seqs} sequences"
        )
    for name, t in f32:
        _check_f32(name, t)


class DecodeLayer:
    """The attention half of one decoder layer for a step of one-token sequences, in one native
    call (`splitmoe_decode_layer_f32`): input RMSNorm, the qkv projection (+ bias), the per-head
    q/k norm (optional) and RoPE, the KV store, decode attention, the output projection added to
    the residual stream, the post-attention RMSNorm and, on MoE layers, the router's top-k. The
    same steps as `AttentionModel`'s per-op path with the other native kernels (the GEMMs are
    the native ones, not MKL's, so results agree to rounding).

    Built once per layer from its float32 weights: ``w_qkv [(nh + 2 nkv) d, H]`` (bias
    ``[(nh + 2 nkv) d]`` or None), ``qk_head_norm [nh + nkv, d]`` or None, ``o_proj [H, nh d]``,
    ``router [E, H]`` or None (dense layer). Keeps the transposed copies the GEMMs read and the
    pointer arguments that do not change between steps."""

    def __init__(
        self,
        input_norm: torch.Tensor,
        post_norm: torch.Tensor,
        w_qkv: torch.Tensor,
        b_qkv: torch.Tensor | None,
        qk_head_norm: torch.Tensor | None,
        o_proj: torch.Tensor,
        router: torch.Tensor | None,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        top_k: int,
        renormalize: bool,
    ):
        H = input_norm.shape[0]
        nh, nkv, d = num_heads, num_kv_heads, head_dim
        named = {"input_norm": input_norm, "post_norm": post_norm, "w_qkv": w_qkv}
        named.update(o_proj=o_proj, b_qkv=b_qkv, qk_head_norm=qk_head_norm, router=router)
        for name, t in named.items():
            if t is not None:
                _check_f32(name, t)
        want = {
            "input_norm": (H,),
            "post_norm": (H,),
            "w_qkv": ((nh + 2 * nkv) * d, H),
            "o_proj": (H, nh * d),
            "b_qkv": ((nh + 2 * nkv) * d,),
            "qk_head_norm": (nh + nkv, d),
        }
        for name, shape in want.items():
            if named[name] is not None and tuple(named[name].shape) != shape:
                raise ValueError(
                    f"cpu kernels: decode layer {name} is {tuple(named[name].shape)}, want {shape}"
                )
        if d % 2 or d > MAX_HEAD_DIM:
            raise ValueError(f"cpu kernels: head_dim {d} must be even and at most {MAX_HEAD_DIM}")
        E = 0 if router is None else router.shape[0]
        if router is not None and (router.shape != (E, H) or not 1 <= top_k <= E <= 4096):
            raise ValueError(
                f"cpu kernels: router {tuple(router.shape)} must be [E, {H}] with 1 <= top_k "
                f"({top_k}) <= E <= 4096"
            )
        self.hidden, self.top_k = H, top_k
        self._rows = f"contiguous float32 [T, {H}] with one token per sequence"  # (for errors)
        self.has_router = router is not None
        # GEMM weights as [K, N] for the row-major GEMMs; all in one huge-page arena
        kept = [input_norm, post_norm, w_qkv.t(), b_qkv, qk_head_norm, o_proj.t()]
        kept.append(None if router is None else router.t())
        present = iter(host_memory.pack([t.contiguous() for t in kept if t is not None]))
        self._keep = [None if t is None else next(present) for t in kept]
        in_n, post_n, wqkv_t, b, qkn, wo_t, router_t = (
            None if t is None else t.data_ptr() for t in self._keep
        )
        self._weights = (in_n, post_n, eps, wqkv_t, b, qkn)
        self._tail = (nh, nkv, d)
        self._out_weights = (wo_t, router_t, E, top_k if router is not None else 0, renormalize)
        # for `DecodeStep`: what its layers must share, and the weights' addresses in the order
        # of the C `struct step_layer` (0: none)
        self.shape = (H, nh, nkv, d, eps, E, top_k, bool(renormalize))
        self.addresses = [a or 0 for a in (in_n, post_n, wqkv_t, b, qkn, wo_t, router_t)]

    def __call__(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Updates ``h [T, H]`` (contiguous float32, one token per sequence of ``meta``) in place
        and returns the post-attention normed ``x [T, H]`` and, on MoE layers, the routing
        ``ids [T, k]`` int64 and ``weights [T, k]`` float32 (None, None on dense layers)."""
        T, H = h.shape
        _check_step_call(
            "decode layer",
            h,
            H == self.hidden and h.is_contiguous() and h.dtype == torch.float32,
            self._rows,
            meta,
            (("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)),
        )
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("cpu kernels: k_cache and v_cache must be contiguous")
        x = torch.empty(T, H, dtype=torch.float32)
        k = self.top_k if self.has_router else 0
        ids = torch.empty(T, k, dtype=torch.int64) if k else None
        weights = torch.empty(T, k, dtype=torch.float32) if k else None
        rc = library().splitmoe_decode_layer_f32(
            h.data_ptr(),
            T,
            H,
            *self._weights,
            cos.data_ptr(),
            sin.data_ptr(),
            cos.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            *_cache_args(meta, k_cache),
            *self._tail,
            scale,
            *self._out_weights,
            x.data_ptr(),
            None if ids is None else ids.data_ptr(),
            None if weights is None else weights.data_ptr(),
        )
        _raise_step_error(rc, "decode layer", k_cache)
        return x, ids, weights


def _alike_moe_layers(what: str, layers: list[DecodeLayer]) -> tuple:
    """The `DecodeLayer.shape` of ``layers``, which a whole-model call (`DecodeStep`,
    `RemoteDecode`) needs to be alike MoE layers of at most `MAX_TOP_K` experts a token."""
    shape = layers[0].shape
    if any(not layer.has_router or layer.shape != shape for layer in layers):
        raise ValueError(f"cpu kernels: {what} layers must all be alike MoE layers")
    if shape[6] > MAX_TOP_K:
        raise ValueError(f"cpu kernels: {what} takes top_k <= {MAX_TOP_K}, got {shape[6]}")
    return shape


def _check_shapes(what: str, named: dict[str, tuple[torch.Tensor, tuple]]) -> None:
    """Each ``name: (tensor, shape)`` float32, contiguous and of that shape."""
    for name, (t, shape) in named.items():
        _check_f32(name, t)
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(
                f"cpu kernels: {what} {name} is {tuple(t.shape)}, want {shape} contiguous"
            )


def _check_kv_pool(what: str, kv_pool: torch.Tensor, L: int, nkv: int, d: int) -> None:
    """The paged cache a whole-model call reads: ``[L, 2, blocks, block_size, nkv, d]``,
    contiguous."""
    if kv_pool.dim() != 6 or kv_pool.shape[:2] != (L, 2) or kv_pool.shape[4:] != (nkv, d):
        raise ValueError(
            f"cpu kernels: {what} kv_pool is {tuple(kv_pool.shape)}, want [{L}, 2, blocks, "
            f"block_size, {nkv}, {d}]"
        )
    if not kv_pool.is_contiguous():
        raise ValueError(f"cpu kernels: {what} kv_pool must be contiguous")


class DecodeStep:
    """A whole decode step of a model whose layers are all MoE layers with every expert on this
    rank (colocated), in one native call (`splitmoe_decode_step_f32`): the embedding, each
    layer's `DecodeLayer` and routed experts (`fused_moe`) added to the residual stream, the
    final RMSNorm and the LM head. Hidden states are bit-identical to those per-layer calls; the
    LM head is a native GEMM (not MKL's), so the logits agree with ``F.linear`` to rounding.

    At decode batch sizes the per-layer calls' wrappers, the tensors they allocate and the LM
    head in PyTorch cost as much as the layers' arithmetic: a colocated batch-32 step of the
    default model spent ~40% of its time outside the native kernels.

    Built once from the model's `DecodeLayer`s (every one with a router), each layer's experts
    in `expert_layout` (``w13t [E, H, 2I]``, ``w2t [E, I, H]``), ``embed [V, H]``,
    ``final_norm [H]`` and ``lm_head [V, H]``, all float32 and contiguous (the final norm's eps is
    the layers'). Holds the layers and
    tensors (not copies) and calls with their addresses: weights changed in place (an expert
    reloaded into its slot) are seen by the next step."""

    def __init__(
        self,
        layers: list[DecodeLayer],
        experts: list[tuple[torch.Tensor, torch.Tensor]],
        embed: torch.Tensor,
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
    ):
        if not layers or len(experts) != len(layers):
            raise ValueError(
                f"cpu kernels: decode step takes one expert pair per layer; got {len(layers)} "
                f"layers and {len(experts)} expert pairs"
            )
        H, nh, nkv, d, eps, E, k, renorm = _alike_moe_layers("decode step", layers)
        V, I = embed.shape[0], experts[0][1].shape[1]
        named = {"embed": (embed, (V, H)), "final_norm": (final_norm, (H,))}
        named["lm_head"] = (lm_head, (V, H))
        for i, (w13t, w2t) in enumerate(experts):
            named[f"w13t[{i}]"], named[f"w2t[{i}]"] = (w13t, (E, H, 2 * I)), (w2t, (E, I, H))
        _check_shapes("decode step", named)
        self._keep = [list(layers), embed, final_norm, lm_head, *(t for p in experts for t in p)]
        self._layers = torch.tensor(
            [layer.addresses + [w13t.data_ptr(), w2t.data_ptr()]
             for layer, (w13t, w2t) in zip(layers, experts)],
            dtype=torch.int64,
        )  # fmt: skip
        self.vocab, self.heads = V, (nh, nkv, d)
        self._model = (embed.data_ptr(), V, H, self._layers.data_ptr(), len(layers), eps)
        self._moe = (E, k, int(renorm), I, final_norm.data_ptr(), lm_head.data_ptr())

    def __call__(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """The logits ``[T, V]`` float32 of a step of one-token sequences: ``input_ids [T]``
        int64 (one token per sequence of ``meta``), RoPE ``cos / sin`` rows as `DecodeLayer`
        takes them, and the paged cache ``kv_pool [L, 2, blocks, block_size, nkv, d]``
        (contiguous float32) into which each layer's K / V are stored."""
        T = input_ids.shape[0]
        _check_step_call(
            "decode step",
            input_ids,
            input_ids.dtype == torch.int64 and input_ids.dim() == 1 and input_ids.is_contiguous(),
            "contiguous int64 input ids [T], one per sequence",
            meta,
            (("cos", cos), ("sin", sin), ("kv_pool", kv_pool)),
        )
        nh, nkv, d = self.heads
        L = self._layers.shape[0]
        _check_kv_pool("decode step", kv_pool, L, nkv, d)
        logits = torch.empty(T, self.vocab, dtype=torch.float32)
        rc = library().splitmoe_decode_step_f32(
            input_ids.data_ptr(),
            T,
            *self._model,
            cos.data_ptr(),
            sin.data_ptr(),
            cos.stride(0),
            kv_pool.data_ptr(),
            kv_pool.stride(0),
            kv_pool.stride(1),
            *_cache_args(meta, kv_pool),
            *self.heads,
            scale,
            *self._moe,
            logits.data_ptr(),
        )
        if rc == -2:
            raise ValueError(f"cpu kernels: decode step got a token id outside 0..{self.vocab - 1}")
        _raise_step_error(rc, "decode step", kv_pool)
        return logits


@dataclass(frozen=True)
class Rings:
    """A rank's shared-memory rings with each peer of the other role, as `RemoteDecode` and
    `ExpertCall` take them (`splitmoe.comm.shm`'s layout; `FlatTransport.native_frames` builds
    it): the base address of the ring towards (``out``) and from (``into``) each peer, the
    address of the count of bytes from each one its lane staged (``staged``: a frame that begins
    there is left to the caller), the data bytes of the rings each way (``capacities``: out,
    into) and how long a call polls for a frame before it hands the wait back (``spin_ns``)."""

    out: list[int]
    into: list[int]
    staged: list[int]
    capacities: tuple[int, int]
    spin_ns: int

    def table(self) -> torch.Tensor:
        """``[3, peers]`` int64: the ``out``, ``into`` and ``staged`` addresses, the order of
        the C structs' ring fields."""
        return torch.tensor([self.out, self.into, self.staged], dtype=torch.int64)


def _check_mirrors() -> None:
    """That the ctypes mirrors of the C structs (`_RemoteModel`, `_RemoteBatch`, `_ExpertCall`,
    in ``splitmoe_remote_struct_bytes``' order) have the C sizes: a field added on one side
    only would move every field after it."""
    lib = library()
    for i, mirror in enumerate((_RemoteModel, _RemoteBatch, _ExpertCall)):
        if lib.splitmoe_remote_struct_bytes(i) != ctypes.sizeof(mirror):
            raise RuntimeError(f"cpu kernels: {mirror.__name__} does not match the C source")


class _RemoteModel(ctypes.Structure):
    """The C ``struct remote_model`` (see `RemoteDecode`)."""

    _fields_ = [
        *((name, _p if name == "layers" else _i64) for name in ("layers", "L", "H", "nh", "nkv")),
        *((name, _i64) for name in ("d", "E", "k", "renorm", "V")),
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        *((name, _p) for name in ("embed", "final_norm", "lm_head", "kv")),
        *((name, _i64) for name in ("kv_layer_st", "kv_v_off", "num_blocks", "block_size")),
        *((name, _p) for name in ("expert_slot", "load", "slot_rank", "slot_local")),
        ("num_slots", _i64),
        ("R", _i64),
        *((name, _p) for name in ("rings_out", "rings_in", "staged_in")),
        *((name, _i64) for name in ("cap_out", "cap_in", "spin_ns")),
    ]


class _RemoteBatch(ctypes.Structure):
    """The C ``struct remote_batch`` (see `RemoteBatch`)."""

    _fields_ = [
        ("m", _p),
        ("T", _i64),
        *((name, _p) for name in ("input_ids", "positions", "block_tables")),
        *((name, _i64) for name in ("table_st", "table_width")),
        *((name, _p) for name in ("rope_cos", "rope_sin")),
        ("rope_rows", _i64),
        *((name, _p) for name in ("cos_t", "sin_t")),
        ("cs_st", _i64),
        *((name, _p) for name in ("seq_lens", "slots", "h", "x", "weights", "partial", "sum")),
        *((name, _p) for name in ("ids", "token_index", "rows", "counts", "sent", "got")),
        *((name, _p) for name in ("stamps", "logits")),
        *((name, _i64) for name in ("max_len", "P", "pending", "waiting", "wait_rank")),
    ]


class RemoteDecode:
    """An attention rank's decode step whose routed experts live on expert ranks reached over
    shared-memory rings, in one native call per (layer, micro-batch) (`splitmoe_remote_layer`):
    the combine of the previous layer's partial sums off the rings and the residual add, the
    `DecodeLayer` (layer 0: after the embedding), and the dispatch of `DispatchSend`; after the
    last layer its combine, the final RMSNorm and the LM head. The same kernels in the same order
    as `AttentionModel.forward` with `FlatTransport.dispatch_static` / `combine` and then
    `AttentionModel.logits`, so hidden states and logits are bit-identical to theirs, and the
    same frames on the rings: the expert ranks cannot tell the two apart.

    At decode batch sizes the Python around those kernels (the forward loop, the decode layer's
    wrapper, the dispatch's routing and bookkeeping, the combine's frames and sums) cost about as
    much as the kernels on the attention rank, which with two micro-batches is the one that sets
    the pace.

    Built once per rank from the model's `DecodeLayer`s (all MoE layers: a router, no shared
    expert), ``embed [V, H]``, ``final_norm [H]``, ``lm_head [V, H]``, the paged ``kv_pool [L, 2,
    blocks, block_size, nkv, d]`` (float32, contiguous), the transport's ``slot_rank /
    slot_local [S]`` and the `Rings` with the expert ranks. `set_maps` gives each layer's
    expert -> slot map and load counts; `batch` one micro-batch's buffers and call."""

    def __init__(
        self,
        layers: list[DecodeLayer],
        embed: torch.Tensor,
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        kv_pool: torch.Tensor,
        scale: float,
        slot_rank: torch.Tensor,
        slot_local: torch.Tensor,
        rings: Rings,
    ):
        _check_mirrors()
        H, nh, nkv, d, eps, E, k, renorm = _alike_moe_layers("remote decode", layers)
        L, V = len(layers), embed.shape[0]
        _check_shapes(
            "remote decode",
            {
                "embed": (embed, (V, H)),
                "final_norm": (final_norm, (H,)),
                "lm_head": (lm_head, (V, H)),
            },
        )
        _check_f32("kv_pool", kv_pool)
        _check_kv_pool("remote decode", kv_pool, L, nkv, d)
        R = len(rings.out)
        self._layers = torch.tensor(
            [layer.addresses + [0, 0] for layer in layers], dtype=torch.int64
        )
        self._rings = rings.table()
        self._maps = torch.zeros(2, L, dtype=torch.int64)  # expert_slot, load addresses per layer
        self._keep = [list(layers), embed, final_norm, lm_head, slot_rank, slot_local]
        self.pool = kv_pool
        self._held: list = []  # the maps' tensors
        self.num_layers, self.num_ranks, self.hidden, self.top_k, self.vocab = L, R, H, k, V
        self.head_dim = d
        self._rope: torch.Tensor | None = None  # the RoPE table `batch` last checked
        nb, bs = kv_pool.shape[2:4]
        self._model = _RemoteModel(
            self._layers.data_ptr(), L, H, nh, nkv, d, E, k, int(renorm), V, eps, scale,
            embed.data_ptr(), final_norm.data_ptr(), lm_head.data_ptr(), kv_pool.data_ptr(),
            kv_pool.stride(0), kv_pool.stride(1), nb, bs,
            self._maps[0].data_ptr(), self._maps[1].data_ptr(),
            slot_rank.data_ptr(), slot_local.data_ptr(), slot_rank.numel(), R,
            *(ring.data_ptr() for ring in self._rings), *rings.capacities, rings.spin_ns,
        )  # fmt: skip
        self._batches: dict[int, RemoteBatch] = {}

    def set_maps(self, maps: list[tuple[torch.Tensor | None, torch.Tensor | None]]) -> None:
        """Each layer's ``(expert_slot [E], load [E])`` int64, contiguous, as
        `DispatchSend` takes them (None: the expert id is its slot / not counted); held until
        the next call."""
        addresses = [[0 if t is None else t.data_ptr() for t in pair] for pair in maps]
        self._maps.copy_(torch.tensor(addresses, dtype=torch.int64).t())
        self._held = maps

    def batch(self, j: int, inputs: DecodeInputs, cos: torch.Tensor, sin: torch.Tensor
              ) -> RemoteBatch:  # fmt: skip
        """Micro-batch j of this step: its `DecodeInputs`, and a RoPE table ``cos, sin [n, 1,
        d]`` float32 with a row for each position (`AttentionModel.rope_table`). Its buffers are
        reused by the next step's micro-batch j."""
        if cos is not self._rope:  # (checked once per table: it changes only as it grows)
            d = self.head_dim
            for name, t in (("cos", cos), ("sin", sin)):
                if t.dtype != torch.float32 or t.shape[-1] != d or not t.is_contiguous():
                    raise ValueError(
                        f"cpu kernels: remote decode takes a contiguous float32 RoPE table "
                        f"{name} [positions, 1, {d}]; got {t.dtype} {tuple(t.shape)}"
                    )
            if sin.shape != cos.shape:
                raise ValueError(
                    f"cpu kernels: remote decode's RoPE tables differ in shape: cos "
                    f"{tuple(cos.shape)}, sin {tuple(sin.shape)}"
                )
            self._rope = cos
        T = len(inputs)
        b = self._batches.get(j)
        if b is None or b.T != T:
            b = self._batches[j] = RemoteBatch(self, T)
        b.start(inputs, cos, sin)
        return b


@dataclass
class DecodeInputs:
    """A micro-batch of one-token sequences as `RemoteDecode` takes it (numpy, C-contiguous):
    ``token_ids [T]`` int64, each one's ``positions [T]`` int64 (the tokens before it in the
    cache) and ``block_tables [T, width]`` int32, each row a sequence's block ids (padded). The
    lengths, KV slots and RoPE rows are derived natively."""

    token_ids: np.ndarray
    positions: np.ndarray
    block_tables: np.ndarray

    def __post_init__(self) -> None:
        T = self.token_ids.shape[0]
        for name, a, dtype, dim in (
            ("token_ids", self.token_ids, np.int64, 1),
            ("positions", self.positions, np.int64, 1),
            ("block_tables", self.block_tables, np.int32, 2),
        ):
            if a.dtype != dtype or a.ndim != dim or a.shape[0] != T or not a.flags.c_contiguous:
                raise ValueError(
                    f"cpu kernels: remote decode takes {name} as a C-contiguous {np.dtype(dtype)} "
                    f"array of {dim} dimension(s) with a row per sequence ({T}); got "
                    f"{a.dtype} {a.shape}"
                )

    def __len__(self) -> int:
        return self.token_ids.shape[0]


class RemoteBatch:
    """One micro-batch of a `RemoteDecode` step. ``layer(i)`` (i = 0 .. L) is the native call
    (`splitmoe_remote_layer`'s return codes: 0 done; 1 the frame of expert rank `wait_rank` has
    not arrived, starts in the lane's staging or is not the size expected: receive it into
    ``partial`` at `pending_frame` through the lane (which waits, or reports the diverged
    calls), then `got` it and call again; 2 the frames of the ranks `unsent` lists did not fit
    their rings: send them from ``rows``).
    ``counts [L, R]``: the rows sent to each expert rank per layer; ``stamps [L + 1, 4]``: the
    clock (ns) at each call's start, once its combine, its layer and its dispatch were done;
    ``logits [T, V]``, written by call L."""

    def __init__(self, owner: RemoteDecode, T: int):
        L, R, H, k = owner.num_layers, owner.num_ranks, owner.hidden, owner.top_k
        P = T * min(k, R)
        f32 = functools.partial(torch.empty, dtype=torch.float32)
        i64 = functools.partial(torch.empty, dtype=torch.int64)
        self.T = T
        self.h, self.x, self.sum, self.weights = f32(T, H), f32(T, H), f32(T, H), f32(T, k)
        self.partial, self.logits = f32(P, H), f32(T, owner.vocab)
        self.cos, self.sin = f32(T, owner.head_dim), f32(T, owner.head_dim)
        self.seq_lens, self.slots = i64(T), i64(T)
        self.ids, self.token_index = i64(T, k), i64(P)
        self.rows = torch.empty(P, H * 4 + 8 * k, dtype=torch.uint8)
        self.counts, self.flags, self.stamps = i64(L, R), i64(2, R), i64(L + 1, 4)
        self.counts_np, self.stamps_np = self.counts.numpy(), self.stamps.numpy()
        self._sent, self._got = self.flags.numpy()
        self._owner = owner  # (its model struct outlives this batch)
        self._c = _RemoteBatch(ctypes.addressof(owner._model), T)
        for name in ("h", "x", "weights", "partial", "sum", "ids", "token_index", "rows"):
            setattr(self._c, name, getattr(self, name).data_ptr())
        for name in ("seq_lens", "slots", "logits"):
            setattr(self._c, name, getattr(self, name).data_ptr())
        self._c.cos_t, self._c.sin_t = self.cos.data_ptr(), self.sin.data_ptr()
        self._c.cs_st = owner.head_dim
        self._c.counts, self._c.stamps = self.counts.data_ptr(), self.stamps.data_ptr()
        self._c.sent, self._c.got = self.flags[0].data_ptr(), self.flags[1].data_ptr()
        self._address = ctypes.addressof(self._c)
        self._call = library().splitmoe_remote_layer
        self._inputs: tuple = ()

    def start(self, inputs: DecodeInputs, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self._inputs = (inputs, cos, sin)  # alive for the step's calls
        c = self._c
        c.input_ids, c.positions = inputs.token_ids.ctypes.data, inputs.positions.ctypes.data
        tables = inputs.block_tables  # (C-contiguous: a row's stride is its width)
        c.block_tables, c.table_st = tables.ctypes.data, tables.shape[1]
        c.table_width = c.table_st
        c.rope_cos, c.rope_sin, c.rope_rows = cos.data_ptr(), sin.data_ptr(), cos.shape[0]
        c.pending = c.waiting = 0

    def layer(self, i: int) -> int:
        rc = self._call(self._address, i)
        if rc == -6:  # a frame not the size expected: the lane's receive reports the divergence
            return 1
        if rc < 0:
            self._raise(rc)
        return rc

    def _raise(self, rc: int) -> None:
        if rc == -2:
            raise ValueError(
                f"cpu kernels: remote decode got a token id outside 0..{self._owner.vocab - 1}"
            )
        if rc == -5:
            raise ValueError(
                "cpu kernels: remote decode routed to an expert id or slot out of range"
            )
        _raise_step_error(rc, "remote decode", self._owner.pool)

    @property
    def wait_rank(self) -> int:
        """The expert rank whose frame the call left to the caller (`layer` returned 1)."""
        return self._c.wait_rank

    def pending_frame(self, layer: int, r: int) -> tuple[int, int]:
        """``(byte offset in partial, bytes)`` of expert rank r's partial sums of ``layer``."""
        counts = self.counts_np[layer]
        rb = self.partial.shape[1] * 4
        return int(counts[:r].sum()) * rb, int(counts[r]) * rb

    def got(self, r: int) -> None:
        self._got[r] = 1

    def unsent(self, layer: int) -> list[tuple[int, int, int]]:
        """``(expert rank, byte offset in rows, bytes)`` of the frames the last call left."""
        return _unsent(self.counts_np[layer].tolist(), self._sent, self.rows.shape[1])


class _ExpertCall(ctypes.Structure):
    """The C ``struct expert_call`` (see `ExpertCall`)."""

    _fields_ = [
        *((name, _i64) for name in ("H", "k", "I", "A")),
        *((name, _p) for name in ("layers", "rings_out", "rings_in", "staged_in")),
        *((name, _i64) for name in ("cap_out", "cap_in", "spin_ns")),
        ("rows", _p),
        ("y", _p),
        ("capacity", _i64),
        *((name, _p) for name in ("counts", "got", "sent", "stamps")),
        *((name, _i64) for name in ("N", "waiting", "wait_rank", "need")),
    ]


class ExpertCall:
    """An expert rank's share of one MoE layer and micro-batch in one native call
    (`splitmoe_expert_layer`), the tokens coming from the attention ranks over shared-memory
    rings: each attention rank's frame of packed rows (an empty one included) taken off its
    ring, `fused_moe_rows` on them, and each one's partial sums sent back as a frame (none where
    it sent no rows). The same frames and bits as `FlatTransport.receive`,
    `LocalExperts.compute_batch` and `FlatTransport.send_back`, without their ~30 us of Python a
    layer and micro-batch (on the 2-core CPU host, where a 16-token micro-batch's experts cost
    ~60 us).

    Built once per rank from the hidden size, top_k, the experts' intermediate size and the
    `Rings` with the attention ranks. `set_layers` gives the
    MoE layers' expert weights. ``layer(i)``'s return codes: 0 done; 1 the frame of attention
    rank `wait_rank` is not here whole (receive it at `receive_at`, then `got` it, and call
    again); 3 the buffers lack room for it (`grow`, then call again); 2 done, but the partial
    sums of the ranks `unsent` lists did not fit their rings (send them from ``y``). After a
    call: ``counts`` rows from each attention rank, ``N`` their sum, ``rows`` and ``y`` (first
    N), ``stamps [4]`` the clock (ns) at its start, once received, computed and sent."""

    def __init__(
        self,
        hidden: int,
        top_k: int,
        intermediate: int,
        rings: Rings,
    ):
        _check_mirrors()
        if top_k > MAX_TOP_K:
            raise ValueError(f"cpu kernels: expert calls take top_k <= {MAX_TOP_K}, got {top_k}")
        A = len(rings.out)
        self.hidden, self.top_k, self.intermediate = hidden, top_k, intermediate
        self._rings = rings.table()
        self._state = torch.zeros(3, A, dtype=torch.int64)  # counts, got, sent
        self.stamps = torch.zeros(4, dtype=torch.int64)
        self.counts, self._got, self._sent = self._state.numpy()
        self.stamps_np = self.stamps.numpy()
        self._c = _ExpertCall(
            hidden, top_k, intermediate, A, 0, *(r.data_ptr() for r in self._rings),
            *rings.capacities, rings.spin_ns, 0, 0, 0, *(t.data_ptr() for t in self._state),
            self.stamps.data_ptr(),
        )  # fmt: skip
        self._layers = torch.zeros(0, 3, dtype=torch.int64)
        self._held: list = []
        self.grow(64)
        self._address = ctypes.addressof(self._c)
        self._call = library().splitmoe_expert_layer

    def set_layers(self, weights: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The MoE layers' ``(w13t [E, H, 2I], w2t [E, I, H])`` (`expert_layout`, float32,
        contiguous), in the order `layer` numbers them; held until the next call."""
        table = []
        for w13t, w2t in weights:
            E, I = _expert_weights(w13t, w2t, self.hidden, "expert call", w13t.shape)
            if I != self.intermediate:
                raise ValueError(
                    f"cpu kernels: expert call weights have I = {I}, not {self.intermediate}"
                )
            table.append([w13t.data_ptr(), w2t.data_ptr(), E])
        self._layers = torch.tensor(table, dtype=torch.int64).view(-1, 3)
        self._held = weights
        self._c.layers = self._layers.data_ptr()

    def grow(self, rows: int) -> None:
        """Room for ``rows`` received rows (at least twice the old room), keeping the rows
        received so far."""
        c = self._c
        n, old = max(rows, 2 * c.capacity), getattr(self, "rows", None)
        self.rows = torch.empty(n, 4 * self.hidden + 8 * self.top_k, dtype=torch.uint8)
        self.y = torch.empty(n, self.hidden, dtype=torch.float32)
        if old is not None:
            self.rows[: old.shape[0]] = old
        c.rows, c.y, c.capacity = self.rows.data_ptr(), self.y.data_ptr(), n

    def layer(self, i: int) -> int:
        rc = self._call(self._address, i)
        if rc < 0 and rc != -6:  # (-6: a frame not of whole rows, which the receive reports)
            E = int(self._layers[i, 2])
            _check_moe_rc(rc, E, self.top_k)
        return 1 if rc == -6 else rc

    @property
    def N(self) -> int:
        return self._c.N

    @property
    def wait_rank(self) -> int:
        return self._c.wait_rank

    @property
    def need(self) -> int:
        return self._c.need

    def receive_at(self, a: int) -> int:
        """The byte offset in ``rows`` where attention rank a's rows go."""
        return int(self.counts[:a].sum()) * self.rows.shape[1]

    def got(self, a: int, rows: int) -> None:
        self.counts[a], self._got[a] = rows, 1

    def unsent(self) -> list[tuple[int, int, int]]:
        """``(attention rank, byte offset in y, bytes)`` of the partial sums the last call
        left."""
        return _unsent(self.counts.tolist(), self._sent, self.hidden * 4)


def _unsent(counts: list[int], sent, row_bytes: int) -> list[tuple[int, int, int]]:
    """``(peer, byte offset, bytes)`` of each peer's ``counts[peer]`` rows (in peer order) whose
    frame a native call could not send (``sent[peer]`` 0)."""
    out, at = [], 0
    for peer, n in enumerate(counts):
        if not sent[peer]:
            out.append((peer, at * row_bytes, n * row_bytes))
        at += n
    return out
