"""Frozen configuration objects, each validated where it is built.

A job is described by four small pieces: the model (`ModelConfig`, read from a checkpoint's
``config.json``), how ranks are split (`ParallelConfig`), the paged KV cache (`CacheConfig`) and the
request scheduler (`SchedulerConfig`). `EngineConfig` bundles them for the rank processes. Each
role receives only the slices it needs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

BACKENDS = ("auto", "torch", "triton", "cpu")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str, checkpoint_dtype: str, device: str) -> torch.dtype:
    """``"auto"``: the checkpoint's dtype on CUDA, float32 on CPU (CPU bf16 GEMMs are slow)."""
    if name == "auto":
        if device == "cpu":
            return torch.float32
        name = checkpoint_dtype if checkpoint_dtype in _DTYPES else "bfloat16"
    if name not in _DTYPES:
        raise ValueError(
            f"dtype={name!r} is not supported; use one of 'auto', 'float32', 'bfloat16', 'float16'"
        )
    return _DTYPES[name]


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and family quirks of a supported MoE checkpoint (see `splitmoe.models.families`)."""

    path: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[int, ...]
    dense_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    qkv_bias: bool = False
    qk_norm: str = "none"  # "none" | "head" (Qwen3: per head) | "full" (OLMoE: whole projection)
    clip_qkv: float | None = None
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads} in {self.path}/config.json"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be between 1 and num_experts="
                f"{self.num_experts} in {self.path}/config.json"
            )
        if self.qk_norm not in ("none", "head", "full"):
            raise ValueError(f"qk_norm={self.qk_norm!r} must be 'none', 'head' or 'full'")

    @property
    def is_moe_layer(self) -> tuple[bool, ...]:
        return tuple(i in set(self.moe_layers) for i in range(self.num_layers))

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Reads ``config.json`` of an HF-format checkpoint directory; errors name what is wrong."""
        from splitmoe.models.families import family_for

        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(
                f"model directory {str(root)!r} does not exist; pass a checkpoint directory with "
                "config.json and *.safetensors (`python -m splitmoe.models.default_model "
                "--out DIR` writes a small one)"
            )
        if not root.is_dir():
            raise NotADirectoryError(f"model path {str(root)!r} is a file; pass its directory")
        cfg_file = root / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{str(root)!r} has no config.json: is it an HF checkpoint?")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
        family = family_for(raw.get("model_type"), cfg_file)
        return cls(path=str(root), **family.parse_config(raw, cfg_file))


@dataclass(frozen=True)
class ParallelConfig:
    """How the world is split: ranks ``0..A-1`` are attention ranks, ``A..A+E-1`` expert ranks."""

    attention_ranks: int = 1
    expert_ranks: int = 0
    transport: str = "flat"
    # Ranks that share a fast local link (a "node"). None: from the launcher (LOCAL_WORLD_SIZE,
    # OMPI_COMM_WORLD_LOCAL_SIZE), or the whole world for `LLM`. Set it to emulate several nodes.
    ranks_per_node: int | None = None
    # Micro-batches per step (ping-pong: attention of one overlaps the experts of another).
    # None: chosen each step from the batch (see `micro_batches_for`).
    micro_batches: int | None = None
    # Collective and start-up timeout: a rank that stops answering ends the job after this long.
    timeout_s: float = 30.0
    # Expert load balancing (see splitmoe.scheduler.balancer): extra expert slots per MoE layer
    # holding replicas of hot experts, the per-step replica choice, and how often (steps) the
    # placement is recomputed from observed load (None: only on `LLM.rebalance()`).
    redundant_experts: int = 0
    balancer: str = "static"
    rebalance_interval: int | None = None
    # Ranks on one host exchange tokens and control messages through shared memory (~15 us a
    # round trip) rather than gloo over loopback TCP (~200 us), when the data plane is on the
    # CPU. False: always torch.distributed.
    shared_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.attention_ranks, int) or self.attention_ranks < 1:
            raise ValueError(f"attention_ranks={self.attention_ranks!r} must be an integer >= 1")
        if not isinstance(self.expert_ranks, int) or self.expert_ranks < 0:
            raise ValueError(
                f"expert_ranks={self.expert_ranks!r} must be an integer >= 0 (0 = colocated)"
            )
        from splitmoe.comm.transport import TRANSPORTS

        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"transport={self.transport!r} is not available; choose one of {sorted(TRANSPORTS)}"
            )
        if not isinstance(self.shared_memory, bool):
            raise ValueError(f"shared_memory={self.shared_memory!r} must be True or False")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be > 0")
        if self.micro_batches is not None and (
            not isinstance(self.micro_batches, int) or not 1 <= self.micro_batches <= 16
        ):
            raise ValueError(
                f"micro_batches={self.micro_batches!r} must be None (automatic) or 1..16"
            )
        if self.ranks_per_node is not None and (
            not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1
        ):
            raise ValueError(f"ranks_per_node={self.ranks_per_node!r} must be None or an int >= 1")
        if (
            isinstance(self.redundant_experts, bool)
            or not isinstance(self.redundant_experts, int)
            or self.redundant_experts < 0
        ):
            raise ValueError(
                f"redundant_experts={self.redundant_experts!r} must be an integer >= 0 "
                "(extra expert slots per MoE layer for replicas of hot experts)"
            )
        from splitmoe.scheduler.balancer import POLICIES

        if self.balancer not in POLICIES:
            raise ValueError(
                f"balancer={self.balancer!r} must be one of {', '.join(map(repr, POLICIES))}"
            )
        if self.balancer != "static" and self.expert_ranks == 0:
            raise ValueError(
                f"balancer={self.balancer!r} chooses between replicas on expert ranks; with "
                "expert_ranks=0 (colocated) use balancer='static' or add expert ranks"
            )
        if self.rebalance_interval is not None:
            if (
                isinstance(self.rebalance_interval, bool)
                or not isinstance(self.rebalance_interval, int)
                or self.rebalance_interval < 1
            ):
                raise ValueError(
                    f"rebalance_interval={self.rebalance_interval!r} must be None (only on "
                    "LLM.rebalance()) or an integer >= 1 (steps)"
                )
            if self.expert_ranks == 0:
                raise ValueError(
                    "rebalance_interval moves experts between expert ranks; with expert_ranks=0 "
                    "(colocated) leave it None"
                )

    @property
    def world_size(self) -> int:
        return self.attention_ranks + self.expert_ranks

    # Below this many tokens on the busiest attention rank, splitting a step costs more latency
    # (one more round trip per layer) than the overlap gains.
    MIN_TOKENS_TO_SPLIT = 8

    def micro_batches_for(self, tokens_per_rank: tuple[int, ...], shared_gpu: bool = False) -> int:
        """Micro-batches of a step, from the all-gathered token counts: the same on every rank.
        Automatic: 2 when there is something to overlap (expert ranks, and at least
        `MIN_TOKENS_TO_SPLIT` tokens on the busiest attention rank), else 1. ``shared_gpu``:
        the ranks share their GPUs (several ranks per device, exchanging through the host), so
        attention and expert kernels take turns on one device and nothing overlaps: 1. (One
        H100, 1+1, default model: m=2 decoded 0.70-0.84x as fast as m=1 at batch 32-256.)"""
        if self.micro_batches is not None:
            return self.micro_batches
        if self.expert_ranks == 0 or shared_gpu or max(tokens_per_rank) < self.MIN_TOKENS_TO_SPLIT:
            return 1
        return 2

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    @property
    def num_redundant(self) -> int:
        """Replica slots per MoE layer actually used: colocated runs ignore ``redundant_experts``
        (every expert is local)."""
        return self.redundant_experts if self.expert_ranks else 0

    def check_model(self, model: ModelConfig) -> None:
        if self.expert_ranks > model.num_experts:
            raise ValueError(
                f"expert_ranks={self.expert_ranks} exceeds the model's {model.num_experts} "
                f"experts: every expert rank needs at least one expert; use expert_ranks <= "
                f"{model.num_experts}"
            )
        if self.expert_ranks:
            from splitmoe.scheduler.placement import check_fits

            check_fits(model.num_experts, self.expert_ranks, self.redundant_experts)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: ``num_kv_blocks`` blocks of ``block_size`` tokens per layer.

    ``num_kv_blocks=None`` sizes the pool from ``kv_cache_memory_gb`` (per attention rank),
    capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens could ever use.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size={self.block_size!r} must be an integer >= 1")
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1
        ):
            raise ValueError(
                f"num_kv_blocks={self.num_kv_blocks!r} must be None or an integer >= 1"
            )
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb={self.kv_cache_memory_gb!r} must be > 0")

    def resolve_num_blocks(
        self, model: ModelConfig, dtype: torch.dtype, max_num_seqs: int, max_model_len: int
    ) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        elem = torch.empty((), dtype=dtype).element_size()
        per_block = (
            2 * model.num_layers * self.block_size * model.num_kv_heads * model.head_dim * elem
        )
        from_budget = int(self.kv_cache_memory_gb * (1 << 30)) // per_block
        needed = max_num_seqs * math.ceil(max_model_len / self.block_size)
        return max(1, min(from_budget, needed))


@dataclass(frozen=True)
class SchedulerConfig:
    """Per attention rank: at most ``max_num_seqs`` running requests and ``max_num_batched_tokens``
    new tokens per step (prompt chunks and decode tokens together)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(
                f"max_model_len={self.max_model_len!r} must be None or an integer >= 2"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything a rank process needs to build its role."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dtype: str = "auto"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    seed: int = 0
    threads_per_rank: int | None = None
    # "auto" (triton on CUDA; on CPU the native "cpu" kernels for float32 ranks where they
    # build, else torch) | "torch" | "triton" | "cpu"
    attention_backend: str = "auto"
    moe_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device={self.device!r} must be 'auto', 'cpu' or 'cuda'")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but CUDA is not available; use 'cpu'")
        resolve_dtype(self.dtype, self.model.checkpoint_dtype, self.device_type)
        self.parallel.check_model(self.model)
        if self.max_model_len > self.model.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                f"{self.model.max_position_embeddings}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} must be an integer >= 0")
        for name in ("attention_backend", "moe_backend"):
            if getattr(self, name) not in BACKENDS:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} must be one of {', '.join(BACKENDS)}"
                )
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank={self.threads_per_rank!r} must be None or >= 1")
        for name in ("attention_backend", "moe_backend"):
            if getattr(self, name) == "cpu":
                self._check_cpu_kernels(name)

    def _check_cpu_kernels(self, name: str) -> None:
        from splitmoe.kernels import cpu_native

        if not self.native_cpu_eligible:
            raise ValueError(
                f"{name}='cpu' runs float32 on CPU; this run is {self.torch_dtype} on "
                f"{self.device_type}: use {name}='auto' or dtype='float32', device='cpu'"
            )
        try:
            cpu_native.library()  # built here, once, before any rank starts
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{name}='cpu' is not available here: {e}") from e

    @property
    def device_type(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.model.checkpoint_dtype, self.device_type)

    def backend(self, name: str) -> str:
        """Resolved ``attention_backend`` / ``moe_backend``: ``auto`` is Triton on CUDA; on CPU,
        the native kernels for a rank that runs float32, where they build
        (`kernels.cpu_native`), else the PyTorch paths."""
        value = getattr(self, name)
        if value != "auto":
            return value
        if self.device_type == "cuda":
            return "triton"
        if self.native_cpu_eligible:
            from splitmoe.kernels import cpu_native

            return "cpu" if cpu_native.available() else "torch"
        return "torch"

    @property
    def native_cpu_eligible(self) -> bool:
        """Whether this run's device and dtype are those of the native CPU kernels."""
        return self.device_type == "cpu" and self.torch_dtype == torch.float32

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len or self.model.max_position_embeddings
