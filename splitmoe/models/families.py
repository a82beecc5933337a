"""One small adapter per model family: config keys and checkpoint tensor names.

Every role loads tensors by *canonical* names (``"q_proj"``, ``"router"``, ``("expert", "gate")``);
an adapter maps them to the family's checkpoint names. Shapes are checked centrally against
`ModelConfig` (see `splitmoe.models.loader`), so an adapter only says what its family calls things.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitmoe.models import gpt_oss

# Canonical per-layer tensors held by attention ranks.
ATTENTION_KEYS = ("input_norm", "post_norm", "q_proj", "k_proj", "v_proj", "o_proj")
BIAS_KEYS = ("q_bias", "k_bias", "v_bias")
QK_NORM_KEYS = ("q_norm", "k_norm")
ROUTER_KEY = "router"
DENSE_KEYS = ("mlp_gate", "mlp_up", "mlp_down")
SHARED_KEYS = ("shared_gate", "shared_up", "shared_down", "shared_expert_gate")
EXPERT_KEYS = ("gate", "up", "down")
SINK_KEYS = ("sinks",)  # GPT-OSS: one learned softmax-denominator logit per query head


@dataclass(frozen=True)
class Family:
    """Base adapter: Llama-style names (``model.layers.{i}.self_attn.q_proj.weight`` ...)."""

    model_type: str
    moe_prefix: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # experts stored as one [E, ...] tensor per layer and projection (GPT-OSS), not one per expert
    fused_experts: bool = False

    # ---- config -------------------------------------------------------------------------------
    def parse_config(self, raw: dict[str, Any], cfg_file: Path) -> dict[str, Any]:
        def need(key: str, *alts: str) -> Any:
            for k in (key, *alts):
                if raw.get(k) is not None:
                    return raw[k]
            raise ValueError(f"{cfg_file} lacks {key!r}, which a {self.model_type} model needs")

        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(
                f"{cfg_file}: rope type {rope_type!r} is not supported yet (only default RoPE)"
            )
        if raw.get("use_sliding_window"):
            raise ValueError(f"{cfg_file}: use_sliding_window=true is not supported")
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        layers = int(need("num_hidden_layers"))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        fields = dict(
            model_type=self.model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            max_position_embeddings=int(need("max_position_embeddings")),
            num_experts=int(need("num_experts", "num_local_experts")),
            top_k=int(need("num_experts_per_tok")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            checkpoint_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )
        fields.update(self.family_fields(raw, need, layers))
        return fields

    def family_fields(self, raw: dict[str, Any], need, layers: int) -> dict[str, Any]:
        raise NotImplementedError

    # ---- tensor names -------------------------------------------------------------------------
    def global_name(self, key: str) -> str:
        return {
            "embed": "model.embed_tokens.weight",
            "final_norm": "model.norm.weight",
            "lm_head": "lm_head.weight",
        }[key]

    def layer_name(self, layer: int, key: str) -> str:
        p = f"model.layers.{layer}"
        moe = f"{p}.{self.moe_prefix}"
        return {
            "input_norm": f"{p}.input_layernorm.weight",
            "post_norm": f"{p}.post_attention_layernorm.weight",
            "q_proj": f"{p}.self_attn.q_proj.weight",
            "k_proj": f"{p}.self_attn.k_proj.weight",
            "v_proj": f"{p}.self_attn.v_proj.weight",
            "o_proj": f"{p}.self_attn.o_proj.weight",
            "q_bias": f"{p}.self_attn.q_proj.bias",
            "k_bias": f"{p}.self_attn.k_proj.bias",
            "v_bias": f"{p}.self_attn.v_proj.bias",
            "q_norm": f"{p}.self_attn.q_norm.weight",
            "k_norm": f"{p}.self_attn.k_norm.weight",
            "router": f"{moe}.gate.weight",
            "mlp_gate": f"{p}.mlp.gate_proj.weight",
            "mlp_up": f"{p}.mlp.up_proj.weight",
            "mlp_down": f"{p}.mlp.down_proj.weight",
            "shared_gate": f"{moe}.shared_expert.gate_proj.weight",
            "shared_up": f"{moe}.shared_expert.up_proj.weight",
            "shared_down": f"{moe}.shared_expert.down_proj.weight",
            "shared_expert_gate": f"{moe}.shared_expert_gate.weight",
            "o_bias": f"{p}.self_attn.o_proj.bias",
            "sinks": f"{p}.self_attn.sinks",
            "router_bias": f"{moe}.gate.bias",
        }[key]

    def expert_name(self, layer: int, expert: int, key: str) -> str:
        gate, up, down = self.expert_names
        name = {"gate": gate, "up": up, "down": down}[key]
        return f"model.layers.{layer}.{self.moe_prefix}.experts.{expert}.{name}.weight"


def _qwen_moe_layers(raw: dict[str, Any], layers: int, num_experts: int) -> tuple[int, ...]:
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    return tuple(
        i for i in range(layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0
    )


@dataclass(frozen=True)
class Qwen3Moe(Family):
    """Qwen3-MoE: RMSNorm on every q/k head before RoPE; optional dense layers."""

    def family_fields(self, raw, need, layers):
        num_experts = int(need("num_experts", "num_local_experts"))
        return dict(
            moe_intermediate_size=int(need("moe_intermediate_size")),
            dense_intermediate_size=int(raw.get("intermediate_size") or 0),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            moe_layers=_qwen_moe_layers(raw, layers, num_experts),
            qkv_bias=bool(raw.get("attention_bias", False)),
            qk_norm="head",
        )


@dataclass(frozen=True)
class Qwen2Moe(Family):
    """Qwen2-MoE: qkv bias, a shared expert behind a sigmoid gate, no top-k renormalisation."""

    def family_fields(self, raw, need, layers):
        num_experts = int(need("num_experts"))
        return dict(
            moe_intermediate_size=int(need("moe_intermediate_size")),
            dense_intermediate_size=int(raw.get("intermediate_size") or 0),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            moe_layers=_qwen_moe_layers(raw, layers, num_experts),
            qkv_bias=bool(raw.get("qkv_bias", True)),
        )


@dataclass(frozen=True)
class Mixtral(Family):
    """Mixtral: ``block_sparse_moe`` with w1 (gate), w3 (up), w2 (down); top-k renormalised."""

    def family_fields(self, raw, need, layers):
        if raw.get("sliding_window"):
            raise ValueError(
                f"{self.model_type}: sliding_window={raw['sliding_window']} is not supported"
            )
        return dict(
            moe_intermediate_size=int(need("intermediate_size")),
            norm_topk_prob=True,
            moe_layers=tuple(range(layers)),
        )


@dataclass(frozen=True)
class Olmoe(Family):
    """OLMoE: RMSNorm over the whole q and k projections, optional clip_qkv."""

    def family_fields(self, raw, need, layers):
        clip = raw.get("clip_qkv")
        return dict(
            moe_intermediate_size=int(need("intermediate_size")),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            moe_layers=tuple(range(layers)),
            qkv_bias=bool(raw.get("attention_bias", False)),
            qk_norm="full",
            clip_qkv=None if clip is None else float(clip),
        )


@dataclass(frozen=True)
class GptOss(Family):
    """GPT-OSS: attention sinks, alternating sliding-window / full layers, biases on attention,
    router and experts, the clamped SwiGLU, softmax over the top-k router logits, YaRN RoPE.
    Experts fused per layer (``mlp.experts.gate_up_proj [E, H, 2I]``, gate/up interleaved), or
    MXFP4 (``*_blocks`` / ``*_scales``): see `splitmoe.models.gpt_oss`."""

    def parse_config(self, raw: dict[str, Any], cfg_file: Path) -> dict[str, Any]:
        from_rope = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling")}
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        theta = rope.get("rope_theta", raw.get("rope_theta", 150000.0))
        fields = super().parse_config(dict(from_rope, rope_theta=theta), cfg_file)
        fields["rope_scaling"] = gpt_oss.rope_scaling(rope, cfg_file)
        return fields

    def family_fields(self, raw, need, layers):
        window = int(raw.get("sliding_window") or 0)
        types = raw.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ]
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if len(types) != layers or unknown:
            raise ValueError(
                f"gpt_oss: layer_types must list 'sliding_attention' / 'full_attention' for each "
                f"of the {layers} layers; got {types}"
            )
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if sliding and window < 1:
            raise ValueError("gpt_oss: sliding_attention layers need sliding_window >= 1")
        bias = bool(raw.get("attention_bias", True))
        return dict(
            moe_intermediate_size=int(need("intermediate_size")),
            norm_topk_prob=False,
            moe_layers=tuple(range(layers)),
            qkv_bias=bias,
            o_bias=bias,
            attention_sinks=True,
            sliding_window=window if sliding else 0,
            sliding_layers=sliding,
            router_bias=True,
            router_scoring="topk_softmax",
            expert_bias=True,
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            quant_method=gpt_oss.quant_method(raw),
        )

    def layer_name(self, layer: int, key: str) -> str:
        if key in ("router", "router_bias"):
            return f"model.layers.{layer}.mlp.router.{'weight' if key == 'router' else 'bias'}"
        return super().layer_name(layer, key)


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Qwen3Moe("qwen3_moe"),
    "qwen2_moe": Qwen2Moe("qwen2_moe"),
    "mixtral": Mixtral("mixtral", moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2")),
    "olmoe": Olmoe("olmoe"),
    "gpt_oss": GptOss("gpt_oss", fused_experts=True),
}


def family_for(model_type: str | None, cfg_file: Path | str = "config.json") -> Family:
    if model_type not in FAMILIES:
        raise ValueError(
            f"model_type={model_type!r} in {cfg_file} is not supported; supported families: "
            f"{', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]
