"""A checkpoint's model as the engine sees it: shapes and family quirks (`ModelConfig`, read from
``config.json`` through the family adapters of `splitmoe.models.families`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from splitmoe.models.families import family_for
from splitmoe.models.routing import check_routing


def kv_values_per_token(num_kv_heads: int, head_dim: int, kv_lora_rank: int = 0) -> int:
    """Values one token holds in one layer's KV cache: under multi-head latent attention
    (``kv_lora_rank`` > 0) the latent vector and the rotary key of ``head_dim``, else a key and
    a value per KV head. The one rule the attention ranks allocate by and the simulator
    (`splitmoe.sim.model`) sizes caches with."""
    if kv_lora_rank:
        return kv_lora_rank + head_dim
    return 2 * num_kv_heads * head_dim


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
    shared_expert_intermediate_size: int = 0  # on MoE layers, on the attention rank
    shared_expert_gate: bool = False  # a sigmoid gate [1, H] on the shared expert (Qwen2-MoE)
    # Routing (see `splitmoe.models.routing`): scores, choice, weights
    scoring_func: str = "softmax"  # "softmax" | "sigmoid"
    router_bias: bool = False  # e_score_correction_bias [E], for choosing experts only
    topk_method: str = "greedy"  # "greedy" | "group_limited_greedy" | "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # RoPE (`splitmoe.models.rope`): "default" | "linear" | "yarn", its parameters as pairs
    rope_type: str = "default"
    rope_scaling: tuple[tuple[str, object], ...] = ()
    # Multi-head latent attention (DeepSeek-V2/V3, `splitmoe.attention_nodes.mla`): set when
    # kv_lora_rank > 0; head_dim is then qk_rope_head_dim (the rotary part, as HF sets it)
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary pairs (x0, x1), (x2, x3)... rather than halves
    attention_bias: bool = False  # MLA: biases on q_a_proj, kv_a_proj_with_mqa and o_proj
    qkv_bias: bool = False
    qk_norm: str = "none"  # "none" | "head" (Qwen3: per head) | "full" (OLMoE: whole projection)
    clip_qkv: float | None = None
    rotary_dim: int | None = None  # RoPE rotates the first rotary_dim dims of a head (None: all)
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str = "float32"
    # "fp8": block-quantized weights (float8 + weight_scale_inv per weight_block_size block),
    # dequantized to the run dtype at load (`splitmoe.models.loader`); "mxfp4" (GPT-OSS's
    # experts as *_blocks / *_scales, dequantized at load by `splitmoe.models.gpt_oss`)
    quantization: str | None = None
    weight_block_size: tuple[int, int] = (128, 128)
    # GPT-OSS (`splitmoe.models.gpt_oss`): a learned per-head logit in every softmax's
    # denominator, a window of ``sliding_window`` keys on ``sliding_layers`` (the rest attend to
    # the whole context), a bias on o_proj, the router's logits and the experts, and the clamped
    # SwiGLU (its top-k softmax routing is ``scoring_func="topk_softmax"``).
    attention_sinks: bool = False
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    o_bias: bool = False
    router_logit_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None  # None: silu(gate) * up
    swiglu_alpha: float = 1.702

    def layer_window(self, layer: int) -> int | None:
        """Keys layer ``layer`` attends to (None: the whole context)."""
        return self.sliding_window if layer in self.sliding_layers else None

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
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0
        ):
            raise ValueError(
                f"rotary dims {self.rotary_dim} (head_dim times partial_rotary_factor, or "
                f"rotary_dim) must be even and within head_dim={self.head_dim} in "
                f"{self.path}/config.json"
            )
        check_routing(self)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_values_per_token(self) -> int:
        """Values one token holds in one layer's KV cache (`kv_values_per_token`)."""
        return kv_values_per_token(self.num_kv_heads, self.head_dim, self.kv_lora_rank)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes of one token over all layers, at ``dtype_bytes`` per value (what the
        attention ranks allocate per token, and what the simulator sizes caches with)."""
        return self.num_layers * self.kv_values_per_token * dtype_bytes

    @property
    def is_moe_layer(self) -> tuple[bool, ...]:
        return tuple(i in set(self.moe_layers) for i in range(self.num_layers))

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Reads ``config.json`` of an HF-format checkpoint directory; errors name what is wrong."""
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
