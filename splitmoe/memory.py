"""One memory model: the bytes each rank holds for a model and a layout of ranks.

`rank_memory` is the one place that sizes a rank. The planner CLI (`splitmoe.plan_memory`), the
start-up check of `splitmoe.LLM` (`check_fits`) and the cluster simulator (`splitmoe.sim`) all
call it, so what the planner promises is what the runtime allocates.

A rank holds three things:

* **weights**, in the layout the runtime keeps them (`splitmoe.kernels.quant.QuantizedWeight`):
  a ``fp8`` release keeps every decoder linear (attention projections, shared experts, dense
  MLPs, routed experts) at 1 byte a weight plus one float32 scale per ``bn x bk`` block; an
  ``mxfp4`` release (GPT-OSS) keeps its routed experts at 17 bytes per 32 weights. Embeddings,
  the LM head, norms, routers and biases stay in the run dtype. An attention rank holds
  everything but the routed experts; an expert rank the routed-expert slots placed on it
  (`splitmoe.comm.topology.contiguous_placement`: ``ceil(slots / E)`` on the fullest rank);
  colocated (``E = 0``), every attention rank holds all of them.
* **KV cache** (attention ranks): ``kv_tokens`` tokens in each full-attention layer and
  ``window_tokens`` in each sliding-window layer, each token ``kv_values_per_token`` values
  (the MLA latent plus rotary key for DeepSeek-V3 / Kimi-K2).
* **buffers**: activations and exchange buffers of one step of ``max_num_batched_tokens``
  tokens per attention rank (see `_attention_buffers`, `_expert_buffers`). They are estimates
  of the largest live tensors, not an allocator trace; the simulator passes 0 tokens and keeps
  its 10% headroom instead.

Nothing here reads a weight: a ``config.json`` is enough (`ModelDims.from_config`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 1 << 30

QUANTIZED_FORMATS = ("fp8", "mxfp4")
MXFP4_GROUP = 32  # values sharing one e8m0 scale byte


def linear_bytes(rows: int, cols: int, fmt: str | None, dtype_bytes: float,
                 block: tuple[int, int] = (128, 128)) -> int:  # fmt: skip
    """Resident bytes of one ``[rows, cols]`` weight: ``fmt`` None in the run dtype, ``"fp8"``
    1 byte a weight plus a float32 scale per ``block`` (partial blocks included, as released),
    ``"mxfp4"`` half a byte a weight plus a scale byte per 32 (the layout of
    `splitmoe.kernels.quant.QuantizedWeight`, whose ``nbytes`` this equals)."""
    if fmt is None:
        return int(rows * cols * dtype_bytes)
    if fmt == "fp8":
        bn, bk = block
        return rows * cols + 4 * math.ceil(rows / bn) * math.ceil(cols / bk)
    if fmt == "mxfp4":
        return rows * cols // 2 + rows * (cols // MXFP4_GROUP)
    raise ValueError(f"weight format {fmt!r} is not one of {QUANTIZED_FORMATS}")


@dataclass(frozen=True)
class ModelDims:
    """What sizing a rank needs of a model: its linears as ``(rows, cols)`` and the counts of
    the rest. Built from a runtime `splitmoe.models.config.ModelConfig` (`from_config`) or the
    simulator's `splitmoe.sim.model.ModelShape` (its ``memory_dims``).

    attention_linears: one layer's attention projections as ``(canonical key, rows, cols)``; in
        an fp8 release those the loader keeps fp8 (`splitmoe.models.loader.QUANTIZED_KEYS`)
        count quantized, the rest (MLA's ``kv_b_proj``, split per head) in the run dtype;
    moe_layer_linears: what a MoE layer adds on the attention rank (shared expert);
    dense_layer_linears: a dense layer's MLP; expert_linears: one routed expert (gate+up rows,
    down), quantized in fp8 and mxfp4 releases; router_params: a MoE layer's router (and its
    biases), run dtype; expert_extra_params: per routed expert, unquantized (biases);
    other_params: norms, biases, sinks of the whole model, run dtype;
    kv_values_per_token: one token in one layer's cache (`splitmoe.config.kv_values_per_token`).
    """

    name: str
    hidden: int
    vocab: int
    num_layers: int
    num_moe_layers: int
    num_experts: int
    top_k: int
    moe_intermediate: int
    attention_linears: tuple[tuple[str, int, int], ...]
    expert_linears: tuple[tuple[int, int], ...]
    kv_values_per_token: int
    moe_layer_linears: tuple[tuple[int, int], ...] = ()
    dense_layer_linears: tuple[tuple[int, int], ...] = ()
    router_params: int = 0
    expert_extra_params: int = 0
    other_params: int = 0
    tie_word_embeddings: bool = False
    sliding_layers: int = 0  # layers that cache at most a window of ``sliding_window`` tokens
    sliding_window: int = 0
    quantization: str | None = None  # "fp8" | "mxfp4" | None
    block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        if self.quantization not in (None, *QUANTIZED_FORMATS):
            raise ValueError(
                f"{self.name}: quantization={self.quantization!r} must be None or one of "
                f"{QUANTIZED_FORMATS}"
            )
        if not 0 <= self.num_moe_layers <= self.num_layers:
            raise ValueError(f"{self.name}: num_moe_layers must be within 0..num_layers")

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    def dequantized(self) -> ModelDims:
        """The same model with every weight in the run dtype (a bf16 conversion of a release:
        what the loader held before weights stayed quantized)."""
        from dataclasses import replace

        return replace(self, quantization=None, name=f"{self.name} (dequantized)")

    @classmethod
    def from_config(cls, cfg) -> ModelDims:
        """From a `splitmoe.models.config.ModelConfig` (every family the runtime runs)."""
        H, hd = cfg.hidden_size, cfg.head_dim
        heads, kv = cfg.num_heads, cfg.num_kv_heads
        other = 2 * H * cfg.num_layers + H  # input / post-attention norms, final norm
        if cfg.is_mla:
            qk = cfg.qk_nope_head_dim + hd
            q = cfg.q_lora_rank
            attn = (
                [("q_a_proj", q, H), ("q_b_proj", heads * qk, q)]
                if q
                else [("q_proj", heads * qk, H)]
            )
            attn += [
                ("kv_a_proj", cfg.kv_lora_rank + hd, H),
                ("kv_b_proj", heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                ("o_proj", H, heads * cfg.v_head_dim),
            ]
            other += cfg.num_layers * ((q or 0) + cfg.kv_lora_rank)  # q_a / kv_a norms
            if cfg.attention_bias:
                other += cfg.num_layers * ((q or 0) + cfg.kv_lora_rank + hd + H)
        else:
            attn = [
                ("q_proj", heads * hd, H),
                ("k_proj", kv * hd, H),
                ("v_proj", kv * hd, H),
                ("o_proj", H, heads * hd),
            ]
            per_layer = 0
            if cfg.qkv_bias:
                per_layer += (heads + 2 * kv) * hd
            if cfg.o_bias:
                per_layer += H
            if cfg.qk_norm == "head":
                per_layer += 2 * hd
            elif cfg.qk_norm == "full":
                per_layer += (heads + kv) * hd
            if cfg.attention_sinks:
                per_layer += heads
            other += cfg.num_layers * per_layer
        I, E = cfg.moe_intermediate_size, cfg.num_experts
        S, D = cfg.shared_expert_intermediate_size, cfg.dense_intermediate_size
        router = E * H + E * (cfg.router_bias + cfg.router_logit_bias)
        router += H if cfg.shared_expert_gate else 0
        return cls(
            name=cfg.path,
            hidden=H,
            vocab=cfg.vocab_size,
            num_layers=cfg.num_layers,
            num_moe_layers=len(cfg.moe_layers),
            num_experts=E,
            top_k=cfg.top_k,
            moe_intermediate=I,
            attention_linears=tuple(attn),
            expert_linears=((2 * I, H), (H, I)),
            kv_values_per_token=cfg.kv_values_per_token,
            moe_layer_linears=((2 * S, H), (H, S)) if S else (),
            dense_layer_linears=((2 * D, H), (H, D)) if D else (),
            router_params=router,
            expert_extra_params=(2 * I + H) if cfg.expert_bias else 0,
            other_params=other,
            tie_word_embeddings=cfg.tie_word_embeddings,
            sliding_layers=len(cfg.sliding_layers),
            sliding_window=cfg.sliding_window,
            quantization=cfg.quantization,
            block=tuple(cfg.weight_block_size),
        )

    # ---- weights ------------------------------------------------------------------------------
    def _linears(self, linears, fmt: str | None, dtype_bytes: float) -> int:
        return sum(linear_bytes(r, c, fmt, dtype_bytes, self.block) for r, c in linears)

    def attention_weight_bytes(self, dtype_bytes: float) -> dict[str, int]:
        """An attention rank's weights (all but the routed experts), by layout:
        ``{"fp8": ..., "dtype": ...}`` (fp8 bytes include the scales)."""
        from splitmoe.models.loader import QUANTIZED_KEYS

        fp8 = "fp8" if self.quantization == "fp8" else None
        kept = [(r, c) for key, r, c in self.attention_linears if key in QUANTIZED_KEYS]
        dense = [(r, c) for key, r, c in self.attention_linears if key not in QUANTIZED_KEYS]
        linear = (
            self.num_layers * self._linears(kept, fp8, dtype_bytes)
            + self.num_moe_layers * self._linears(self.moe_layer_linears, fp8, dtype_bytes)
            + self.num_dense_layers * self._linears(self.dense_layer_linears, fp8, dtype_bytes)
        )
        embed = self.vocab * self.hidden * (1 if self.tie_word_embeddings else 2)
        plain = int(
            (embed + self.num_moe_layers * self.router_params + self.other_params) * dtype_bytes
        ) + self.num_layers * self._linears(dense, None, dtype_bytes)
        if fp8:
            return {"fp8": linear, "dtype": plain}
        return {"dtype": linear + plain}

    def expert_bytes(self, dtype_bytes: float) -> dict[str, int]:
        """One routed expert of one layer, by layout (``{"fp8"|"mxfp4"|"dtype": bytes}``)."""
        fmt = self.quantization
        w = self._linears(self.expert_linears, fmt, dtype_bytes)
        extra = int(self.expert_extra_params * dtype_bytes)
        if fmt is None:
            return {"dtype": w + extra}
        return {fmt: w, "dtype": extra} if extra else {fmt: w}


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes. ``weights``: by layout (``"fp8"`` / ``"mxfp4"``: data and scales;
    ``"dtype"``: the run dtype); ``experts``: routed-expert slots per MoE layer it holds."""

    rank: int
    role: str  # "attention" | "expert"
    weights: dict[str, int]
    kv_cache: int
    buffers: int
    experts: int = 0
    capacity: int | None = None  # bytes it may use (None: not checked)

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_cache + self.buffers

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= self.capacity


@dataclass(frozen=True)
class MemoryTable:
    """Every rank's `RankMemory` for one model and layout; ``str()`` prints the table."""

    model: str
    ranks: tuple[RankMemory, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    def role(self, role: str) -> list[RankMemory]:
        return [r for r in self.ranks if r.role == role]

    def with_capacity(self, capacity: int | None) -> MemoryTable:
        from dataclasses import replace

        return replace(self, ranks=tuple(replace(r, capacity=capacity) for r in self.ranks))

    def failures(self) -> list[RankMemory]:
        return [r for r in self.ranks if not r.fits]

    def __str__(self) -> str:
        def gb(b: float) -> str:
            return f"{b / 1e9:.2f}"

        layouts = sorted({k for r in self.ranks for k in r.weights}, key=_layout_order)
        head = f"{'rank':>5} {'role':<10}{'experts':>8}"
        head += "".join(f"{'w ' + k + ' GB':>12}" for k in layouts)
        head += f"{'KV GB':>10}{'buffers GB':>12}{'total GB':>11}{'limit GB':>10}  fits"
        lines = [f"memory per rank: {self.model}", head]
        # ranks of one role with the same figures print once, as a range
        groups: list[list[RankMemory]] = []
        for r in self.ranks:
            if groups and _same_row(groups[-1][-1], r):
                groups[-1].append(r)
            else:
                groups.append([r])
        for g in groups:
            r = g[0]
            name = str(r.rank) if len(g) == 1 else f"{r.rank}-{g[-1].rank}"
            row = f"{name:>5} {r.role:<10}{r.experts or '-':>8}"
            row += "".join(f"{gb(r.weights[k]) if k in r.weights else '-':>12}" for k in layouts)
            limit = "-" if r.capacity is None else gb(r.capacity)
            row += f"{gb(r.kv_cache):>10}{gb(r.buffers):>12}{gb(r.total):>11}{limit:>10}"
            row += "  " + ("-" if r.capacity is None else "yes" if r.fits else "NO")
            lines.append(row)
        lines += list(self.notes)
        return "\n".join(lines)


def _layout_order(k: str) -> tuple[int, str]:
    return ({"fp8": 0, "mxfp4": 1, "dtype": 2}.get(k, 3), k)


def _same_row(a: RankMemory, b: RankMemory) -> bool:
    return (a.role, a.weights, a.kv_cache, a.buffers, a.experts, a.capacity) == (
        b.role, b.weights, b.kv_cache, b.buffers, b.experts, b.capacity
    )  # fmt: skip


def _attention_buffers(dims: ModelDims, tokens: int, max_num_seqs: int, dtype_bytes: float,
                       micro_batches: int) -> int:  # fmt: skip
    """One step of ``tokens`` on an attention rank: the residual stream and its normed copy,
    the widest projection output, the gate/up output of a shared or dense MLP (~6 hidden-sized
    and 2 widest rows a token), the dispatch and combine buffers of each micro-batch (a row out,
    a row back), and float32 logits of ``max_num_seqs`` sequences."""
    if not tokens:
        return 0
    widest = max(
        [r for _, r, _ in dims.attention_linears]
        + [r for r, _ in dims.moe_layer_linears + dims.dense_layer_linears]
    )
    acts = tokens * (6 * dims.hidden + 2 * widest) * dtype_bytes
    comm = 2 * micro_batches * tokens * dims.hidden * dtype_bytes
    logits = max_num_seqs * dims.vocab * 4
    return int(acts + comm + logits)


def _expert_buffers(dims: ModelDims, tokens: int, local_experts: int, dtype_bytes: float,
                    micro_batches: int) -> int:  # fmt: skip
    """One step on an expert rank that receives ``tokens`` rows (each token at most once): its
    (token, local expert) pairs through gate/up ``[P, 2I]``, the activation ``[P, I]`` and down
    ``[P, H]``, the receive and send buffers of each micro-batch, and where the weights are
    quantized one expert dequantized at a time into a reused buffer (the CPU path)."""
    if not tokens or not local_experts:
        return 0
    pairs = tokens * min(dims.top_k, local_experts)
    I, H = dims.moe_intermediate, dims.hidden
    acts = pairs * (3 * I + H) * dtype_bytes
    comm = 2 * micro_batches * tokens * H * dtype_bytes
    tile = 3 * H * I * dtype_bytes if dims.quantization else 0
    return int(acts + comm + tile)


def rank_memory(
    dims: ModelDims,
    attention_ranks: int,
    expert_ranks: int,
    *,
    dtype_bytes: float = 2,
    kv_tokens: float = 0,
    window_tokens: float = 0,
    kv_bytes: float | None = None,
    max_num_batched_tokens: int = 0,
    max_num_seqs: int = 0,
    micro_batches: int = 2,
    redundant_experts: int = 0,
    expert_shards: int = 1,
    attention_tp: int = 1,
    kv_shard: float = 1.0,
    capacity: int | None = None,
) -> MemoryTable:
    """Each rank's bytes for ``dims`` on ``attention_ranks`` + ``expert_ranks`` ranks.

    dtype_bytes: bytes of the run dtype (what unquantized weights and activations take: 2 for
        bf16, 4 for float32); kv_bytes: bytes of a KV-cache value (default ``dtype_bytes``);
    kv_tokens / window_tokens: tokens each attention rank caches per full-attention layer /
        per sliding-window layer;
    max_num_batched_tokens / max_num_seqs: one step's tokens and sequences per attention rank
        (0: no buffers counted); micro_batches: exchange buffers held at once;
    redundant_experts: extra expert slots per MoE layer (replicas), spread with the others;
    expert_shards: colocated only (``expert_ranks == 0``): over how many attention ranks the
        experts are sharded (the runtime: 1, every attention rank holds all; the simulator's
        DeepSeek-style expert parallelism: the instance's size);
    attention_tp / kv_shard: the simulator's tensor-parallel attention: weights split
        ``attention_tp`` ways, the fraction of the KV cache one GPU holds;
    capacity: bytes a rank may use (None: not checked).
    """
    if attention_ranks < 1 or expert_ranks < 0:
        raise ValueError(
            f"attention_ranks={attention_ranks} must be >= 1 and expert_ranks={expert_ranks} >= 0"
        )
    kv_elem = dtype_bytes if kv_bytes is None else kv_bytes
    full_layers = dims.num_layers - dims.sliding_layers
    kv = (full_layers * kv_tokens + dims.sliding_layers * window_tokens) * (
        dims.kv_values_per_token * kv_elem * kv_shard
    )
    slots = dims.num_experts + redundant_experts
    expert = dims.expert_bytes(dtype_bytes)
    holders = expert_ranks or max(1, expert_shards)
    local = math.ceil(slots / holders)  # the fullest rank (contiguous, near-equal ranges)

    def experts_on(n: int) -> dict[str, int]:
        return {k: int(v * n * dims.num_moe_layers) for k, v in expert.items()}

    attn_w = {k: int(v / attention_tp) for k, v in dims.attention_weight_bytes(dtype_bytes).items()}
    attn_buf = _attention_buffers(
        dims, max_num_batched_tokens, max_num_seqs, dtype_bytes, micro_batches
    )
    ranks = []
    for r in range(attention_ranks):
        w = dict(attn_w)
        buf = attn_buf
        n = 0
        if not expert_ranks:
            n = local
            for k, v in experts_on(n).items():
                w[k] = w.get(k, 0) + v
            buf += _expert_buffers(dims, max_num_batched_tokens, n, dtype_bytes, 1)
        ranks.append(RankMemory(r, "attention", w, int(kv), buf, n, capacity))
    base, extra = divmod(slots, max(1, expert_ranks))
    for i in range(expert_ranks):
        n = base + (1 if i < extra else 0)
        buf = _expert_buffers(
            dims, attention_ranks * max_num_batched_tokens, n, dtype_bytes, micro_batches
        )
        ranks.append(RankMemory(attention_ranks + i, "expert", experts_on(n), 0, buf, n, capacity))
    return MemoryTable(dims.name, tuple(ranks))


# ---- the runtime's start-up check -------------------------------------------------------------
class LayoutDoesNotFit(ValueError):
    """A layout whose ranks need more memory than they have; ``table`` says which and why."""

    def __init__(self, message: str, table: MemoryTable):
        super().__init__(message)
        self.table = table


def engine_memory(cfg, capacity: int | None = None) -> MemoryTable:
    """`rank_memory` of an `splitmoe.config.EngineConfig`: its model, ranks, run dtype, the KV
    blocks its attention ranks allocate (`CacheConfig.resolve_num_blocks`, `window_pool_blocks`)
    and one step of its scheduler's tokens."""
    m, sched, cache = cfg.model, cfg.scheduler, cfg.cache
    dtype = cfg.torch_dtype
    dtype_bytes = dtype.itemsize
    blocks = cache.resolve_num_blocks(
        m, dtype, sched.max_num_seqs, cfg.max_model_len, sched.max_num_batched_tokens
    )
    window = cache.window_pool_blocks(m, sched.max_num_seqs, sched.max_num_batched_tokens)
    return rank_memory(
        ModelDims.from_config(m),
        cfg.parallel.attention_ranks,
        cfg.parallel.expert_ranks,
        dtype_bytes=dtype_bytes,
        kv_tokens=blocks * cache.block_size,
        window_tokens=window * cache.block_size,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs,
        # "auto" chooses per step: count two, one ping-pong pair of exchange buffers
        micro_batches=m_b if isinstance(m_b := cfg.parallel.micro_batches, int) else 2,
        redundant_experts=cfg.parallel.num_redundant,
        capacity=capacity,
    )


def _host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where it cannot be read: not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_room(device) -> int | None:
    """Bytes this process could still allocate on ``device`` (a ``torch.device``): on CUDA
    what the device has free plus what PyTorch's allocator holds unused; on CPU the host's
    MemAvailable (None where it cannot be read)."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return _host_available_bytes()


def growth_fits(
    before, after, survivors: list[int], rooms: list[tuple[str, int | None]]
) -> str | None:
    """Whether a fault-tolerant job's surviving expert ranks can grow from the layout of
    ``before`` to that of ``after`` (`splitmoe.config.EngineConfig`s; `engine_memory` sizes
    both): expert rank ``i`` of ``after`` was expert rank ``survivors[i]`` of ``before``, and
    lives on the device ``rooms[i]`` names, which can still take ``rooms[i][1]`` bytes
    (`device_room`; None: unknown, not checked). Each must stay within ``expert_memory_gb``
    when set, and the bytes the ranks of one device add together within that device's room
    (the ranks of a CPU host share its RAM). None when they fit, else why not."""
    old = engine_memory(before).role("expert")
    new = engine_memory(after).role("expert")
    budget = after.parallel.expert_memory_gb
    added: dict[str, int] = {}
    frees: dict[str, list[int]] = {}
    for i, rank in enumerate(new):
        was = old[survivors[i]]
        if budget is not None and rank.total > budget * GIB:
            return (
                f"grown to {rank.experts} slots per layer, expert rank {survivors[i]} would "
                f"hold {rank.total / GIB:.3f} GiB, over expert_memory_gb={budget:g}"
            )
        key, free = rooms[i]
        added[key] = added.get(key, 0) + max(0, rank.total - was.total)
        frees.setdefault(key, []).extend([] if free is None else [free])
    for key, need in added.items():
        if frees[key] and need > min(frees[key]):
            return (
                f"growing the survivors' expert slots needs {need / GIB:.3f} GiB more on "
                f"{key}, which has {min(frees[key]) / GIB:.3f} GiB free"
            )
    return None


def _check_expert_budget(cfg) -> None:
    """``expert_memory_gb``, where set: every expert rank's bytes within it, else
    `LayoutDoesNotFit` with the table."""
    from dataclasses import replace

    budget = cfg.parallel.expert_memory_gb
    if budget is None or not cfg.parallel.expert_ranks:
        return
    table = engine_memory(cfg)
    cap = int(budget * GIB)
    table = replace(
        table,
        ranks=tuple(replace(r, capacity=cap) if r.role == "expert" else r for r in table.ranks),
    )
    over = table.failures()
    if over:
        raise LayoutDoesNotFit(
            f"{table}\nan expert rank needs up to {max(r.total for r in over) / GIB:.3f} GiB, "
            f"over expert_memory_gb={budget:g}: raise it, add expert ranks or lower "
            "max_num_batched_tokens",
            table,
        )


def check_fits(cfg, local_ranks: int | None = None) -> MemoryTable | str:
    """The start-up check of `splitmoe.LLM`: raises `LayoutDoesNotFit` with the table when the
    layout does not fit the device memory, before any rank starts or any weight is read.

    On CUDA each rank has a GPU of its own: every rank against the device's total memory. On
    CPU the ``local_ranks`` rank processes this host starts (default: all) share its RAM: their
    sum against MemAvailable. Expert ranks also against ``expert_memory_gb`` where set.
    Returns the table, or a line saying why nothing was checked."""
    import torch

    _check_expert_budget(cfg)

    if cfg.device_type == "cuda":
        # rank r computes on GPU r % device_count (`splitmoe.comm.distributed`): ranks that
        # share a GPU share its memory
        gpus = torch.cuda.device_count()
        cap = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
        table = engine_memory(cfg, capacity=cap if cfg.parallel.world_size <= gpus else None)
        per_gpu: dict[int, int] = {}
        for r in table.ranks[: local_ranks or len(table.ranks)]:
            per_gpu[r.rank % gpus] = per_gpu.get(r.rank % gpus, 0) + r.total
        gpu, need = max(per_gpu.items(), key=lambda kv: kv[1])
        if need <= cap:
            return table
        raise LayoutDoesNotFit(
            f"{table}\nGPU {gpu} would hold {need / 1e9:.1f} GB of ranks but has "
            f"{cap / 1e9:.1f} GB: add expert ranks (expert_ranks), lower kv_cache_memory_gb, "
            "max_num_batched_tokens or max_num_seqs",
            table,
        )
    avail = _host_available_bytes()
    if avail is None:
        return "memory not checked: the host's available memory cannot be read"
    table = engine_memory(cfg)
    ranks = table.ranks[: local_ranks or len(table.ranks)]
    need = sum(r.total for r in ranks)
    if need <= avail:
        return table
    raise LayoutDoesNotFit(
        f"{table}\nthe {len(ranks)} rank processes on this host need {need / 1e9:.1f} GB "
        f"together but {avail / 1e9:.1f} GB is available: lower kv_cache_memory_gb (or "
        "num_kv_blocks), use fewer ranks, or a smaller dtype",
        table,
    )
