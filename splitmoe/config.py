"""Frozen configuration objects, each validated where it is built.

A job is described by small pieces: the model (`splitmoe.models.config.ModelConfig`, read from
a checkpoint's ``config.json``), how ranks are split (`ParallelConfig`), the paged KV cache
(`CacheConfig`), the request scheduler (`SchedulerConfig`) and the prefill-decode transfers
(`KVTransferConfig`). `EngineConfig` bundles them for the rank processes. Each role receives only
the slices it needs.

This is the one place an engine option is declared (`option`: default and help): `LLM(**options)`
goes through `splitmoe.options.engine_config`, and the launchers' flags come from
`splitmoe.options.add_engine_args` (as vLLM builds its CLI from ``EngineArgs``), so a new option is
one field here. Unknown options are an error. This module imports nothing of the package above it
(models, kernels, engine).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # (a type only: this module imports nothing above it)
    from splitmoe.models.config import ModelConfig


# attention_backend / moe_backend: "auto" is Triton on CUDA and PyTorch on CPU
# (`splitmoe.kernels.backends`, which registers a backend under each other name)
BACKENDS = ("auto", "torch", "triton")
# The transports `splitmoe.comm` registers and the balancer policies of `splitmoe.scheduler`:
# named here so that checking a config needs nothing above this module.
TRANSPORT_NAMES = ("flat", "two_phase", "auto")
BALANCER_POLICIES = ("static", "local", "global")


def option(default, help: str, *, flag: str | None = None, choices: tuple | None = None):
    """A config field that is an engine option: ``LLM(name=...)`` and the launcher's
    ``--name`` (``flag`` where the flag reads otherwise), described by ``help``."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices})


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


@functools.cache
def _cpu_capability() -> dict:
    probe = getattr(torch._C._cpu, "_get_cpu_capability", None)  # (torch >= 2.5)
    return dict(probe()) if probe is not None else {}


def cpu_native_bf16(capability: Mapping[str, object] | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively, and oneDNN (through which the CPU
    path's GEMMs run in bfloat16) uses it: AMX-BF16 tiles or AVX512-BF16 dot products.
    Without them oneDNN converts bfloat16 to float32 per element, and bfloat16 is no faster
    than float32 and rounds more. ``capability``: torch's CPU probe
    (``torch._C._cpu._get_cpu_capability()``, the default), or a stand-in for a test. On
    CPUs other than x86 (ARM's BF16 through ACL) this says False: float32 until measured."""
    caps = _cpu_capability() if capability is None else capability
    if not (caps.get("amx_bf16") or caps.get("avx512_bf16")):
        return False
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_dtype(
    name: str, checkpoint_dtype: str, device: str, *, cpu_bf16: bool | None = None
) -> torch.dtype:
    """The run dtype of ``dtype=name``. ``"auto"``: the checkpoint's dtype on CUDA; on CPU
    bfloat16 where the CPU multiplies it natively (``cpu_bf16``; None asks `cpu_native_bf16`),
    whatever the checkpoint's dtype, as vLLM's and SGLang's CPU backends run, else float32
    (float16 and emulated bfloat16 GEMMs are slower than float32 on CPU)."""
    if name == "auto":
        if device == "cpu":
            native = cpu_native_bf16() if cpu_bf16 is None else cpu_bf16
            return torch.bfloat16 if native else torch.float32
        name = checkpoint_dtype if checkpoint_dtype in _DTYPES else "bfloat16"
    if name not in _DTYPES:
        raise ValueError(
            f"dtype={name!r} is not supported; use one of 'auto', 'float32', 'bfloat16', 'float16'"
        )
    return _DTYPES[name]


@dataclass(frozen=True)
class ParallelConfig:
    """How the world is split: ranks ``0..A-1`` are attention ranks, ``A..A+E-1`` expert ranks."""

    attention_ranks: int = option(1, "data-parallel attention ranks, each with its own KV cache")
    expert_ranks: int = option(0, "ranks holding the routed experts (0: colocated)")
    transport: str = option(
        "flat",
        "attention <-> expert scheme: flat, two_phase (aggregate inside a node, then one message "
        "per destination across nodes) or auto (per layer, by an alpha/beta cost model)",
        choices=TRANSPORT_NAMES,
    )
    ranks_per_node: int | None = option(
        None,
        "ranks that share a fast local link (default: from the launcher, or the whole world for "
        "LLM); set it to emulate several nodes",
    )
    micro_batches: int | str | None = option(
        "auto",
        "micro-batches per step, so that attention and experts overlap (ping-pong): 1..16, or "
        "auto (default): chosen per step from the compute and transfer times the ranks measure",
    )
    timeout_s: float = option(
        30.0,
        "seconds a collective, a step or start-up may take before the job fails",
        flag="--timeout",
    )
    # Expert load balancing (see splitmoe.eplb)
    redundant_experts: int = option(
        0, "extra expert slots per MoE layer for replicas of hot experts"
    )
    balancer: str = option("static", "per-step replica choice", choices=BALANCER_POLICIES)
    rebalance_interval: int | None = option(
        None, "recompute the expert placement from observed load every N steps (default: never)"
    )
    # a round trip an order of magnitude cheaper than gloo's over loopback TCP (data plane on the
    # CPU: `splitmoe.comm.shm`)
    shared_memory: bool = option(
        True,
        "ranks on one host exchange through shared memory rather than torch.distributed "
        "(the flag turns it off)",
        flag="--no-shared-memory",
    )
    fault_tolerance: bool = option(
        False,
        "survive the loss of a rank, dead or silent past timeout_s: the others rebuild their "
        "groups without it, re-place its experts (replicas first, else read from the "
        "checkpoint) or resume its requests, and replay the step; steps then run as one "
        "micro-batch (see docs/fault_tolerance.md)",
    )
    expert_memory_gb: float | None = option(
        None,
        "memory an expert rank may hold (its experts and step buffers), GiB: checked at "
        "start-up, and fault tolerance grows the survivors' expert slots only within it "
        "(default: what the device has)",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.fault_tolerance, bool):
            raise ValueError(f"fault_tolerance={self.fault_tolerance!r} must be True or False")
        if self.fault_tolerance and self.micro_batches not in (None, "auto", 1):
            raise ValueError(
                f"fault_tolerance replays an interrupted step whole, which needs one micro-batch "
                f"per step: use micro_batches=1 or 'auto' (not {self.micro_batches!r})"
            )
        if not isinstance(self.attention_ranks, int) or self.attention_ranks < 1:
            raise ValueError(f"attention_ranks={self.attention_ranks!r} must be an integer >= 1")
        if not isinstance(self.expert_ranks, int) or self.expert_ranks < 0:
            raise ValueError(
                f"expert_ranks={self.expert_ranks!r} must be an integer >= 0 (0 = colocated)"
            )
        if self.transport not in TRANSPORT_NAMES:
            raise ValueError(
                f"transport={self.transport!r} is not available; choose one of "
                f"{', '.join(TRANSPORT_NAMES)}"
            )
        if not isinstance(self.shared_memory, bool):
            raise ValueError(f"shared_memory={self.shared_memory!r} must be True or False")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be > 0")
        if self.expert_memory_gb is not None and (
            isinstance(self.expert_memory_gb, bool)
            or not isinstance(self.expert_memory_gb, (int, float))
            or not self.expert_memory_gb > 0
        ):
            raise ValueError(
                f"expert_memory_gb={self.expert_memory_gb!r} must be None (the device's memory) "
                "or a number of GiB > 0"
            )
        if self.micro_batches not in (None, "auto") and (
            isinstance(self.micro_batches, bool)
            or not isinstance(self.micro_batches, int)
            or not 1 <= self.micro_batches <= 16
        ):
            raise ValueError(
                f"micro_batches={self.micro_batches!r} must be 'auto' (None: the same) or an "
                "integer 1..16"
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
        if self.balancer not in BALANCER_POLICIES:
            raise ValueError(
                f"balancer={self.balancer!r} must be one of "
                f"{', '.join(map(repr, BALANCER_POLICIES))}"
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

    def micro_batches_for(
        self, tokens_per_rank: tuple[int, ...], shared_gpu: bool = False
    ) -> int | None:
        """Micro-batches of a step where the configuration or the step fixes them, from the
        all-gathered token counts (the same on every rank); None where ``"auto"`` leaves the
        choice to measurements (`splitmoe.scheduler.micro_batches.MicroBatchChooser`).
        Automatic is 1 with nothing to overlap: colocated, a single token on every attention
        rank, or ranks that share their GPUs (``shared_gpu``: several ranks per device,
        exchanging through the host, so attention and expert kernels take turns on one device:
        a second micro-batch then overlaps nothing and only adds its own overhead)."""
        if self.micro_batches not in (None, "auto"):
            return self.micro_batches
        # (a micro-batch samples as soon as it is done: with two, a failure in the second would
        # leave the first's tokens appended, and a replay would append them again)
        if self.expert_ranks == 0 or shared_gpu or self.fault_tolerance or max(tokens_per_rank) < 2:
            return 1
        return None

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
            check_fits(model.num_experts, self.expert_ranks, self.redundant_experts)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: ``num_kv_blocks`` blocks of ``block_size`` tokens per layer.

    ``num_kv_blocks=None`` sizes the pool from ``kv_cache_memory_gb`` (per attention rank),
    capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens could ever use.
    """

    block_size: int = option(16, "tokens per KV-cache block")
    num_kv_blocks: int | None = option(
        None, "KV-cache blocks per layer and attention rank (default: from kv_cache_memory_gb)"
    )
    kv_cache_memory_gb: float = option(1.0, "KV-cache memory per attention rank, GiB")
    enable_prefix_caching: bool = option(
        True,
        "reuse the KV blocks of prompt prefixes computed before (the flag turns it off)",
        flag="--no-prefix-caching",
    )

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
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching={self.enable_prefix_caching!r} must be True or False"
            )

    def window_pool_blocks(
        self, model: ModelConfig, max_num_seqs: int, max_num_batched_tokens: int
    ) -> int:
        """Blocks of the sliding-window layers' own pool (0 without such layers), its null block
        included: a request holds at most ``(window - 1) // block_size + 2`` blocks of its
        window plus those of the chunk it computes (`SlidingWindowBlocks`)."""
        if not model.sliding_layers:
            return 0
        per_seq = (model.sliding_window - 1) // self.block_size + 2
        chunks = -(-max_num_batched_tokens // self.block_size)
        need = 1 + max_num_seqs * per_seq + chunks
        return need if self.num_kv_blocks is None else min(need, self.num_kv_blocks + 1)

    def resolve_num_blocks(
        self,
        model: ModelConfig,
        dtype: torch.dtype,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int = 0,
    ) -> int:
        """Blocks of the pool of the full-attention layers (all layers but sliding-window ones,
        whose own pool, `window_pool_blocks`, comes out of the same memory first)."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        elem = torch.empty((), dtype=dtype).element_size()
        per_layer = self.block_size * model.kv_values_per_token * elem
        full_layers = model.num_layers - len(model.sliding_layers)
        window = self.window_pool_blocks(model, max_num_seqs, max_num_batched_tokens)
        window_bytes = window * len(model.sliding_layers) * per_layer
        budget = max(0, int(self.kv_cache_memory_gb * (1 << 30)) - window_bytes)
        needed = max_num_seqs * math.ceil(max_model_len / self.block_size)
        if full_layers == 0:
            return needed
        return max(1, min(budget // (full_layers * per_layer), needed))


@dataclass(frozen=True)
class SchedulerConfig:
    """Per attention rank: at most ``max_num_seqs`` running requests and ``max_num_batched_tokens``
    new tokens per step (prompt chunks and decode tokens together)."""

    max_num_seqs: int = option(64, "running requests per attention rank")
    max_num_batched_tokens: int = option(
        2048, "new tokens per step and attention rank (prompt chunks and decode tokens)"
    )
    max_model_len: int | None = option(
        None, "prompt + generated tokens per request (default: the model's maximum)"
    )

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
class KVTransferConfig:
    """Prefill-decode disaggregation (`splitmoe.kv_transfer`, docs/pd.md): what this instance
    does with requests and how KV blocks move between instances.

    ``kv_role``: "both" (the default) computes prompts and decodes them; "prefill" computes
    prompts and hands their KV blocks to a decode instance; "decode" receives them. A request
    takes part only when it carries ``kv_transfer_params`` (the router sets them).
    """

    kv_role: str = option(
        "both",
        "this instance's part: prefill, decode or both",
        choices=("prefill", "decode", "both"),
    )
    kv_connector: str | None = option(
        None,
        "what moves KV blocks between instances (needed unless kv_role=both)",
        choices=("mooncake",),
    )
    kv_host: str = option("127.0.0.1", "address other instances reach this one's KV at")
    kv_transfer_timeout: float = option(
        30.0, "seconds a prefill instance keeps a request's blocks for its decode instance"
    )
    kv_trusted_agents: str = option(
        "127.0.0.0/8,::1,localhost",
        "networks (CIDR) or host names whose KV agents a decode instance may read from, "
        "comma-separated ('*': any); requests naming others are refused",
    )
    kv_secret_file: str | None = option(
        None,
        "file holding the secret shared by the router and every instance with a KV connector "
        "(else SPLITMOE_KV_SECRET); KV transfers answer only to it",
    )
    kv_max_parked_blocks: int | None = option(
        None,
        "KV blocks a prefill instance keeps parked for decode instances at most (default: "
        "half of each attention rank's pool); beyond, prefill requests get a 503",
    )

    def __post_init__(self) -> None:
        if self.kv_role not in ("prefill", "decode", "both"):
            raise ValueError(f"kv_role={self.kv_role!r} must be 'prefill', 'decode' or 'both'")
        if self.kv_connector not in (None, "mooncake"):
            raise ValueError(f"kv_connector={self.kv_connector!r} must be None or 'mooncake'")
        if self.kv_role != "both" and self.kv_connector is None:
            raise ValueError(
                f"kv_role={self.kv_role!r} needs a connector: set kv_connector='mooncake'"
            )
        if not isinstance(self.kv_host, str) or not self.kv_host:
            raise ValueError(f"kv_host={self.kv_host!r} must be a host name or address")
        if not self.kv_transfer_timeout > 0:
            raise ValueError(f"kv_transfer_timeout={self.kv_transfer_timeout!r} must be > 0")
        from splitmoe.kv_transfer import trusted_agents

        if not isinstance(self.kv_trusted_agents, str):
            raise ValueError(
                f"kv_trusted_agents={self.kv_trusted_agents!r} must be a comma-separated string"
            )
        trusted_agents(self.kv_trusted_agents)  # (raises on a malformed list)
        n = self.kv_max_parked_blocks
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"kv_max_parked_blocks={n!r} must be None or an integer >= 1")
        if self.kv_connector is not None:
            from splitmoe.kv_transfer.auth import require_secret
            from splitmoe.kv_transfer.connectors import check_available

            require_secret(self.kv_secret_file, f"kv_connector={self.kv_connector!r}")
            check_available(self.kv_connector)


@dataclass(frozen=True)
class EngineConfig:
    """Everything a rank process needs to build its role."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    dtype: str = option(
        "auto",
        "auto (on CPU bfloat16 where it has AMX / AVX512-BF16, else float32; on CUDA the "
        "checkpoint's dtype), float32, bfloat16 or float16",
    )
    device: str = option("auto", "where the ranks compute", choices=("auto", "cpu", "cuda"))
    seed: int = option(
        0,
        "seeds the random streams of sampled requests without a seed of their own",
        flag="--engine-seed",
    )
    threads_per_rank: int | None = option(
        None, "torch's CPU threads per rank (default: the node's cores shared by its ranks)"
    )
    pin_cores: bool = option(
        True,
        "CPU ranks run on cores of their own where the node's ranks fit side by side, and then "
        "poll rather than sleep through short waits (the flag turns it off: jobs sharing a host)",
        flag="--no-pin-cores",
    )
    attention_backend: str = option(
        "auto", "attention kernels (auto: triton on CUDA, torch on CPU)", choices=BACKENDS
    )
    moe_backend: str = option(
        "auto", "expert kernels (auto: triton on CUDA, torch on CPU)", choices=BACKENDS
    )
    enforce_eager: bool | None = option(
        None,
        "True: run the model eagerly, no torch.compile of the per-layer compute and no CUDA "
        "graphs; False: both where the device has them (graphs on CUDA only); default: "
        "decided per device (see docs/kernels.md)",
    )
    kernel_settle_s: float | None = option(
        5.0,
        "seconds a CPU rank spends at most at start-up measuring its kernel choices (half "
        "timeout_s at most; what is left runs the reference kernel until a later start or "
        "`splitmoe tune-cpu` measures it)",
    )

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
        settle = self.kernel_settle_s
        if settle is not None and (isinstance(settle, bool) or not settle >= 0):
            raise ValueError(f"kernel_settle_s={settle!r} must be None or seconds >= 0")
        for name in ("attention_backend", "moe_backend"):
            value = getattr(self, name)
            if value == "cpu":
                raise ValueError(
                    f"{name}='cpu' (the native C kernels) no longer exists: the PyTorch backend "
                    f"measured faster on realistic model sizes. Use {name}='auto' or 'torch'"
                )
            if value not in BACKENDS:
                raise ValueError(f"{name}={value!r} must be one of {', '.join(BACKENDS)}")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager={self.enforce_eager!r} must be True, False or None")
        if not isinstance(self.pin_cores, bool):
            raise ValueError(f"pin_cores={self.pin_cores!r} must be True or False")
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank={self.threads_per_rank!r} must be None or >= 1")

    @property
    def device_type(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def compile_model(self) -> bool:
        """Whether the attention ranks compile their per-layer compute: only where
        ``enforce_eager=False`` asks. (The default: on CPU, compiling is no faster than eager
        on the realistic preset; on CUDA, it is not yet checked against the oracles; see
        docs/kernels.md.)"""
        return self.enforce_eager is False

    @property
    def cuda_graphs(self) -> bool:
        """Whether the attention ranks replay decode steps from CUDA graphs: on CUDA, where
        ``enforce_eager=False`` asks (not yet the default: see `compile_model`)."""
        return self.enforce_eager is False and self.device_type == "cuda"

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.model.checkpoint_dtype, self.device_type)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len or self.model.max_position_embeddings


def check_fits(num_experts: int, num_ranks: int, redundant: int) -> None:
    """Whether ``redundant`` replica slots per layer fit ``num_ranks`` expert ranks (a replica
    lives on another rank than its original)."""
    if redundant < 0:
        raise ValueError(f"redundant_experts={redundant} must be >= 0")
    if redundant and num_ranks < 2:
        raise ValueError(
            f"redundant_experts={redundant} needs >= 2 expert ranks (a replica must live on "
            "another rank than its original); use redundant_experts=0 or more expert ranks"
        )
    if redundant > num_experts * (num_ranks - 1):
        raise ValueError(
            f"redundant_experts={redundant}: {num_experts} experts have at most one copy per "
            f"expert rank, so at most {num_experts * (num_ranks - 1)} replicas fit on "
            f"{num_ranks} expert ranks; lower redundant_experts"
        )
