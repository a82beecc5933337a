"""One small adapter per model family: config keys and checkpoint tensor names.

Every role loads tensors by *canonical* names (``"q_proj"``, ``"router"``, ``("expert", "gate")``);
an adapter maps them to the family's checkpoint names. Shapes are checked centrally against
`ModelConfig` (see `splitmoe.models.loader`), so an adapter only says what its family calls things.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitmoe.models.rope import parse_rope

# Canonical per-layer tensors held by attention ranks.
ATTENTION_KEYS = ("input_norm", "post_norm", "q_proj", "k_proj", "v_proj", "o_proj")
BIAS_KEYS = ("q_bias", "k_bias", "v_bias")
QK_NORM_KEYS = ("q_norm", "k_norm")
ROUTER_KEY = "router"
ROUTER_BIAS_KEY = "router_bias"  # e_score_correction_bias, where `ModelConfig.router_bias`
DENSE_KEYS = ("mlp_gate", "mlp_up", "mlp_down")
SHARED_KEYS = ("shared_gate", "shared_up", "shared_down")
SHARED_GATE_KEY = "shared_expert_gate"  # where `ModelConfig.shared_expert_gate`
EXPERT_KEYS = ("gate", "up", "down")
# Multi-head latent attention (DeepSeek-V2/V3): the query (through a low-rank q_a -> norm -> q_b
# when q_lora_rank is set, else one q_proj), the joint KV down-projection with the rotary key,
# its norm, the per-head KV up-projection, and the output projection.
MLA_KEYS = ("input_norm", "post_norm", "kv_a_proj", "kv_a_norm", "kv_b_proj", "o_proj")
MLA_Q_LORA_KEYS = ("q_a_proj", "q_a_norm", "q_b_proj")
MLA_BIAS_KEYS = ("kv_a_bias", "o_bias")  # with q_a_bias under q LoRA (attention_bias)


# Weight formats `splitmoe.models.loader` reads besides plain tensors (``quant_method`` of
# config.json's ``quantization_config``).
QUANT_METHODS = ("fp8", "mxfp4")


def parse_quantization(raw: dict[str, Any], cfg_file: Path | str) -> dict[str, Any]:
    """`ModelConfig`'s ``quantization`` and ``weight_block_size`` from ``quantization_config``;
    a method the loader cannot read is a ValueError naming it."""
    qc = raw.get("quantization_config")
    if not qc:
        return {}
    method = qc.get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(
            f"{cfg_file}: quantization method {method!r} is not supported; splitmoe loads "
            f"{', '.join(QUANT_METHODS)} (fp8: float8_e4m3fn weights with a weight_scale_inv "
            "per block, DeepSeek-V3's released format; mxfp4: GPT-OSS's released experts); use "
            "an unquantized checkpoint otherwise"
        )
    if method == "mxfp4":
        if raw.get("model_type") != "gpt_oss":
            raise ValueError(
                f"{cfg_file}: mxfp4 quantization is read for gpt_oss checkpoints only (their "
                "released expert format); use an unquantized checkpoint"
            )
        return dict(quantization=method)
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(int(b) > 0 for b in block)):
        raise ValueError(
            f"{cfg_file}: fp8 quantization needs weight_block_size [rows, cols] (block-wise "
            f"scales); got {block!r}"
        )
    return dict(quantization=method, weight_block_size=(int(block[0]), int(block[1])))


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
            max_position_embeddings=int(need("max_position_embeddings")),
            num_experts=int(need("num_experts", "num_local_experts", "n_routed_experts")),
            top_k=int(need("num_experts_per_tok")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            checkpoint_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )
        fields.update(parse_rope(raw, cfg_file))
        fields.update(parse_quantization(raw, cfg_file))
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
            "router_bias": f"{moe}.gate.e_score_correction_bias",
            "mlp_gate": f"{p}.mlp.gate_proj.weight",
            "mlp_up": f"{p}.mlp.up_proj.weight",
            "mlp_down": f"{p}.mlp.down_proj.weight",
            "shared_gate": f"{moe}.shared_expert.gate_proj.weight",
            "shared_up": f"{moe}.shared_expert.up_proj.weight",
            "shared_down": f"{moe}.shared_expert.down_proj.weight",
            "shared_expert_gate": f"{moe}.shared_expert_gate.weight",
            "o_bias": f"{p}.self_attn.o_proj.bias",
            "sinks": f"{p}.self_attn.sinks",
            "router_logit_bias": f"{moe}.gate.bias",
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


def first_k_dense_moe_layers(raw: dict[str, Any], layers: int) -> tuple[int, ...]:
    """MoE layers of the DeepSeek-style families (DeepSeek-V2/V3, GLM-4.5): every layer from
    ``first_k_dense_replace`` on (``moe_layer_freq``, which HF ignores for these families, must
    be 1); the first ones are dense MLPs."""
    freq = int(raw.get("moe_layer_freq", 1) or 1)
    if freq != 1:
        raise ValueError(
            f"moe_layer_freq={freq} is not supported (HF transformers, the reference, treats every "
            "layer from first_k_dense_replace on as MoE)"
        )
    first = int(raw.get("first_k_dense_replace") or 0)
    return tuple(range(first, layers))


def grouped_sigmoid_routing(raw: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` routing fields of DeepSeek-V3 / Kimi-K2 / GLM-4.5 (HF's noaux_tc router:
    sigmoid scores, correction bias for the choice, groups scored by their two best experts)."""
    return dict(
        scoring_func="sigmoid",
        router_bias=True,
        topk_method="noaux_tc",
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
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
            shared_expert_gate=bool(raw.get("shared_expert_intermediate_size")),
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


def _rotary_dim(raw: dict[str, Any], head_dim: int, default_factor: float) -> int:
    """Dims of a head that RoPE rotates: ``partial_rotary_factor`` (in ``rope_parameters`` /
    ``rope_scaling`` or top level) times ``head_dim``, as HF's default RoPE computes it."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    return int(head_dim * (default_factor if factor is None else float(factor)))


def _head_dim(raw: dict[str, Any], need) -> int:
    return int(raw.get("head_dim") or int(need("hidden_size")) // int(need("num_attention_heads")))


@dataclass(frozen=True)
class Glm4Moe(Family):
    """GLM-4.5 / 4.6: RoPE on the first half of each head (``partial_rotary_factor``, default
    0.5), qkv bias, optional per-head q/k norm (``use_qk_norm``), DeepSeek-V3 routing (sigmoid,
    ``e_score_correction_bias`` for selection, grouped top-k, ``routed_scaling_factor``), an
    ungated shared expert, and ``first_k_dense_replace`` dense layers. HF's config defaults apply
    to missing keys. The MTP layer the checkpoints append (layer ``num_hidden_layers``) is not
    read."""

    def family_fields(self, raw, need, layers):
        moe_inter = int(need("moe_intermediate_size"))
        return dict(
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rotary_dim=_rotary_dim(raw, _head_dim(raw, need), 0.5),
            moe_intermediate_size=moe_inter,
            dense_intermediate_size=int(need("intermediate_size")),
            shared_expert_intermediate_size=moe_inter * int(raw.get("n_shared_experts", 1) or 0),
            moe_layers=first_k_dense_moe_layers({"first_k_dense_replace": 1, **raw}, layers),
            qkv_bias=bool(raw.get("attention_bias", False)),
            qk_norm="head" if raw.get("use_qk_norm") else "none",
            **grouped_sigmoid_routing(raw),
        )

    def layer_name(self, layer: int, key: str) -> str:
        moe = f"model.layers.{layer}.mlp"
        names = {
            "shared_gate": f"{moe}.shared_experts.gate_proj.weight",
            "shared_up": f"{moe}.shared_experts.up_proj.weight",
            "shared_down": f"{moe}.shared_experts.down_proj.weight",
        }
        return names.get(key) or super().layer_name(layer, key)


@dataclass(frozen=True)
class MiniMaxM2(Family):
    """MiniMax-M2: RoPE on the first ``rotary_dim`` dims of each head, RMSNorm over the whole q
    and k projections, sigmoid routing with ``e_score_correction_bias`` for selection and the
    top-k weights renormalised, Mixtral-style expert names (``block_sparse_moe``, w1/w3/w2).
    As in HF, every layer is MoE and the q/k norms are always applied."""

    def family_fields(self, raw, need, layers):
        head_dim = _head_dim(raw, need)
        rotary = raw.get("rotary_dim")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if raw.get("qk_norm_type", "per_layer") != "per_layer":
            raise ValueError(
                f"{self.model_type}: qk_norm_type={raw['qk_norm_type']!r} is not supported "
                "(only 'per_layer', the norm over the whole q and k projections)"
            )
        if raw.get("shared_intermediate_size"):
            raise ValueError(
                f"{self.model_type}: shared_intermediate_size={raw['shared_intermediate_size']} "
                "is not supported (MiniMax-M2 as HF transformers implements it has no shared "
                "expert)"
            )
        return dict(
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 5e6))),
            rotary_dim=int(rotary) if rotary is not None else _rotary_dim(raw, head_dim, 1.0),
            moe_intermediate_size=int(need("intermediate_size")),
            moe_layers=tuple(range(layers)),
            qk_norm="full",
            scoring_func="sigmoid",
            router_bias=True,
            norm_topk_prob=True,
        )

    def layer_name(self, layer: int, key: str) -> str:
        if key == "router_bias":
            return f"model.layers.{layer}.block_sparse_moe.e_score_correction_bias"
        return super().layer_name(layer, key)


@dataclass(frozen=True)
class Deepseek(Family):
    """DeepSeek-V3 (``deepseek_v3``), Kimi-K2 (``kimi_k2``: DeepSeek-V3's architecture and
    tensor names, 384 experts, as released) and DeepSeek-V2 (``deepseek_v2``): multi-head
    latent attention, shared experts without a gate, the first layers dense. V3 routes by
    sigmoid with a correction bias over expert groups (noaux_tc); V2 by softmax, greedy or
    group-limited. V2's rotary pairs are always interleaved (HF's complex form); V3's when
    ``rope_interleave``."""

    def family_fields(self, raw, need, layers):
        v3 = self.model_type in ("deepseek_v3", "kimi_k2")
        n_shared = int(raw.get("n_shared_experts") or 0)
        moe_inter = int(need("moe_intermediate_size"))
        rope_dim = int(need("qk_rope_head_dim"))
        if rope_dim % 2:
            raise ValueError(f"qk_rope_head_dim={rope_dim} must be even")
        q_lora = raw.get("q_lora_rank")
        fields = dict(
            num_experts=int(need("n_routed_experts")),
            moe_intermediate_size=moe_inter,
            dense_intermediate_size=int(raw.get("intermediate_size") or 0),
            shared_expert_intermediate_size=n_shared * moe_inter,
            moe_layers=first_k_dense_moe_layers(raw, layers),
            head_dim=rope_dim,
            num_kv_heads=1,  # one latent "head" shared by every query head
            kv_lora_rank=int(need("kv_lora_rank")),
            q_lora_rank=None if q_lora is None else int(q_lora),
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
            rope_interleave=bool(raw.get("rope_interleave", True)) if v3 else True,
            attention_bias=bool(raw.get("attention_bias", False)),
        )
        if v3:
            fields.update(grouped_sigmoid_routing(raw))
        else:
            method = raw.get("topk_method") or "greedy"
            fields.update(
                topk_method=method,
                n_group=int(raw.get("n_group") or 1),
                topk_group=int(raw.get("topk_group") or 1),
                # HF's DeepseekV2TopkRouter never renormalises (its configs say false)
                norm_topk_prob=False,
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            )
        return fields

    def layer_name(self, layer: int, key: str) -> str:
        p = f"model.layers.{layer}"
        a = f"{p}.self_attn"
        mla = {
            "q_proj": f"{a}.q_proj.weight",
            "q_a_proj": f"{a}.q_a_proj.weight",
            "q_a_bias": f"{a}.q_a_proj.bias",
            "q_a_norm": f"{a}.q_a_layernorm.weight",
            "q_b_proj": f"{a}.q_b_proj.weight",
            "kv_a_proj": f"{a}.kv_a_proj_with_mqa.weight",
            "kv_a_bias": f"{a}.kv_a_proj_with_mqa.bias",
            "kv_a_norm": f"{a}.kv_a_layernorm.weight",
            "kv_b_proj": f"{a}.kv_b_proj.weight",
            "o_bias": f"{a}.o_proj.bias",
            "shared_gate": f"{p}.mlp.shared_experts.gate_proj.weight",
            "shared_up": f"{p}.mlp.shared_experts.up_proj.weight",
            "shared_down": f"{p}.mlp.shared_experts.down_proj.weight",
        }
        return mla[key] if key in mla else super().layer_name(layer, key)


@dataclass(frozen=True)
class GptOss(Family):
    """GPT-OSS: attention sinks, alternating sliding-window / full layers, biases on attention,
    router and experts, the clamped SwiGLU, softmax over the top-k router logits, YaRN RoPE.
    Experts fused per layer (``mlp.experts.gate_up_proj [E, H, 2I]``, gate/up interleaved), or
    MXFP4 (``*_blocks`` / ``*_scales``): see `splitmoe.models.gpt_oss`."""

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
            router_logit_bias=True,
            scoring_func="topk_softmax",
            expert_bias=True,
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        )

    def layer_name(self, layer: int, key: str) -> str:
        if key in ("router", "router_logit_bias"):
            return f"model.layers.{layer}.mlp.router.{'weight' if key == 'router' else 'bias'}"
        return super().layer_name(layer, key)


FAMILIES: dict[str, Family] = {
    "deepseek_v3": Deepseek("deepseek_v3"),
    "kimi_k2": Deepseek("kimi_k2"),
    "deepseek_v2": Deepseek("deepseek_v2"),
    "qwen3_moe": Qwen3Moe("qwen3_moe"),
    "qwen2_moe": Qwen2Moe("qwen2_moe"),
    "mixtral": Mixtral("mixtral", moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2")),
    "olmoe": Olmoe("olmoe"),
    "glm4_moe": Glm4Moe("glm4_moe"),
    "minimax_m2": MiniMaxM2(
        "minimax_m2", moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2")
    ),
    "gpt_oss": GptOss("gpt_oss", fused_experts=True),
}


def family_for(model_type: str | None, cfg_file: Path | str = "config.json") -> Family:
    if model_type not in FAMILIES:
        raise ValueError(
            f"model_type={model_type!r} in {cfg_file} is not supported; supported families: "
            f"{', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]
