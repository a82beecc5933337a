"""Model shapes for the simulator, from a ``config.json`` of any supported family or DeepSeek-V2/V3.

Only shapes matter here: parameters, FLOPs and bytes per token of each part of a layer, and the
KV cache per token. The runtime's own family adapters parse the families it runs; DeepSeek-V2/V3
and Kimi-K2 (MLA attention, shared experts, leading dense layers) and Step-3 are parsed here.
Memory goes through the runtime's one memory model (`memory_dims`, `splitmoe.memory`). Shipped
configs: ``splitmoe/sim/configs/`` (``qwen3-235b-a22b.json``, ``deepseek-v3.json``,
``kimi-k2.json``, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


@dataclass(frozen=True)
class ModelShape:
    """Per-layer shapes. ``attention`` is ``"gqa"`` (``num_kv_heads`` heads of ``head_dim``) or
    ``"mla"`` (DeepSeek: a compressed KV of ``kv_lora_rank + qk_rope_dim`` per token, decoded
    with the absorbed-weights form, all heads reading the one latent)."""

    name: str
    hidden: int
    num_layers: int
    num_moe_layers: int
    vocab: int
    num_experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int = 0  # shared expert(s) of a MoE layer, on the attention rank
    dense_intermediate: int = 0  # MLP of the non-MoE layers
    attention: str = "gqa"  # "gqa" (MHA/GQA/MQA, Step-3's MFA with q_lora_rank) or "mla"
    num_heads: int = 1
    num_kv_heads: int = 1
    head_dim: int = 1
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    fp8_weights: bool = False  # checkpoint quantised to FP8 (DeepSeek-V3)
    mxfp4_experts: bool = False  # expert weights in MXFP4: 4-bit values + a scale per 32 (GPT-OSS)
    sliding_window: int = 0  # tokens a sliding-window layer attends over and keeps in its cache
    sliding_layers: int = 0  # how many layers have that window (GPT-OSS: every other one)

    def __post_init__(self) -> None:
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"attention={self.attention!r} must be 'gqa' or 'mla'")
        if not 0 < self.num_moe_layers <= self.num_layers:
            raise ValueError(f"{self.name}: needs 1..num_layers MoE layers")

    # ---- parameters per layer -----------------------------------------------------------------
    @property
    def attn_params(self) -> int:
        """Projections of one attention layer, plus the router of a MoE layer (small)."""
        H = self.hidden
        if self.attention == "gqa":
            d = self.head_dim
            q = (
                H * self.num_heads * d
                if not self.q_lora_rank
                else H * self.q_lora_rank + self.q_lora_rank * self.num_heads * d
            )  # Step-3's MFA: a low-rank query factorisation shared by the heads
            return q + H * 2 * self.num_kv_heads * d + self.num_heads * d * H
        qk = self.qk_nope_dim + self.qk_rope_dim
        q = (
            H * self.num_heads * qk
            if not self.q_lora_rank
            else (H * self.q_lora_rank + self.q_lora_rank * self.num_heads * qk)
        )
        kv = H * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank * self.num_heads * (
            self.qk_nope_dim + self.v_head_dim
        )
        return q + kv + self.num_heads * self.v_head_dim * H

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    @property
    def shared_params(self) -> int:
        return 3 * self.hidden * self.shared_intermediate

    @property
    def dense_params(self) -> int:
        return 3 * self.hidden * self.dense_intermediate

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def attention_rank_params(self) -> int:
        """Everything an attention rank holds: all layers' attention, shared experts, routers,
        dense MLPs, embeddings and LM head."""
        return (
            self.num_layers * self.attn_params
            + self.num_moe_layers * (self.shared_params + self.hidden * self.num_experts)
            + self.num_dense_layers * self.dense_params
            + 2 * self.vocab * self.hidden
        )

    @property
    def total_params(self) -> int:
        return self.attention_rank_params + self.num_moe_layers * self.num_experts * (
            self.expert_params
        )

    @property
    def active_params(self) -> int:
        return self.attention_rank_params + self.num_moe_layers * self.top_k * self.expert_params

    # ---- per token ----------------------------------------------------------------------------
    def kv_bytes_per_token(self, elem: int = 2) -> int:
        """KV cache bytes per token and layer, by the runtime's rule (`kv_values_per_token`)."""
        from splitmoe.models.config import kv_values_per_token

        if self.attention == "mla":
            return kv_values_per_token(1, self.qk_rope_dim, self.kv_lora_rank) * elem
        return kv_values_per_token(self.num_kv_heads, self.head_dim) * elem

    def kv_context(self, context: float) -> float:
        """Cached tokens per layer, averaged over the layers, at ``context`` tokens of sequence:
        a sliding-window layer keeps (and attends over) at most its window."""
        if not self.sliding_layers:
            return context
        window = min(context, self.sliding_window)
        full = self.num_layers - self.sliding_layers
        return (full * context + self.sliding_layers * window) / self.num_layers

    def attn_core_flops(self, context: float) -> float:
        """FLOPs of one query token attending over ``context`` cached tokens (scores + values)."""
        if self.attention == "mla":  # absorbed: q and o live in the latent (kv_lora + rope) space
            return 2 * self.num_heads * context * (2 * self.kv_lora_rank + self.qk_rope_dim)
        return 4 * self.num_heads * self.head_dim * context

    def memory_dims(self):
        """These shapes as `splitmoe.memory.ModelDims`: what the one memory model sizes ranks
        from (the simulator's memory answers are the runtime's)."""
        from splitmoe.memory import ModelDims

        H = self.hidden
        if self.attention == "mla":
            qk = self.qk_nope_dim + self.qk_rope_dim
            q, heads = self.q_lora_rank, self.num_heads
            attn = (
                [("q_a_proj", q, H), ("q_b_proj", heads * qk, q)]
                if q
                else [("q_proj", heads * qk, H)]
            )
            attn += [
                ("kv_a_proj", self.kv_lora_rank + self.qk_rope_dim, H),
                ("kv_b_proj", heads * (self.qk_nope_dim + self.v_head_dim), self.kv_lora_rank),
                ("o_proj", H, heads * self.v_head_dim),
            ]
        else:  # (Step-3's low-rank query: a q_a / q_b pair)
            d, q = self.head_dim, self.q_lora_rank
            out = self.num_heads * d
            attn = [("q_a_proj", q, H), ("q_b_proj", out, q)] if q else [("q_proj", out, H)]
            kv = self.num_kv_heads * d
            attn += [("k_proj", kv, H), ("v_proj", kv, H), ("o_proj", H, out)]
        kv_values = self.kv_bytes_per_token(1)
        S, D, I = self.shared_intermediate, self.dense_intermediate, self.moe_intermediate
        quant = "mxfp4" if self.mxfp4_experts else ("fp8" if self.fp8_weights else None)
        return ModelDims(
            name=self.name,
            hidden=H,
            vocab=self.vocab,
            num_layers=self.num_layers,
            num_moe_layers=self.num_moe_layers,
            num_experts=self.num_experts,
            top_k=self.top_k,
            moe_intermediate=I,
            attention_linears=tuple(attn),
            expert_linears=((2 * I, H), (H, I)),
            kv_values_per_token=kv_values,
            moe_layer_linears=((2 * S, H), (H, S)) if S else (),
            dense_layer_linears=((2 * D, H), (H, D)) if D else (),
            router_params=H * self.num_experts,
            sliding_layers=self.sliding_layers,
            sliding_window=self.sliding_window,
            quantization=quant,
        )

    def describe(self) -> str:
        return (
            f"{self.name}: {self.num_layers} layers ({self.num_moe_layers} MoE), hidden "
            f"{self.hidden}, {self.num_experts} experts top-{self.top_k} x {self.moe_intermediate}"
            f", {self.attention.upper()} attention, {self.total_params / 1e9:.1f} B params "
            f"({self.active_params / 1e9:.1f} B active)"
        )

    # ---- loading ------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, path: str | Path) -> ModelShape:
        """``path``: a ``config.json``, a checkpoint directory holding one, or the name of a shipped
        config (``"qwen3-235b-a22b"``, ``"deepseek-v3"``)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            shipped = CONFIG_DIR / f"{path}.json"
            if not shipped.is_file():
                names = sorted(q.stem for q in CONFIG_DIR.glob("*.json"))
                raise FileNotFoundError(
                    f"no model config {str(path)!r}: pass a config.json, a checkpoint "
                    f"directory, or one of {names}"
                )
            p = shipped
        raw = json.loads(p.read_text())
        name = p.stem if p.name != "config.json" else p.parent.name
        if raw.get("model_type") in ("deepseek_v2", "deepseek_v3", "kimi_k2"):
            return cls._from_deepseek(raw, name)
        if raw.get("model_type") in ("step3_text", "step3v"):
            return cls._from_step3(raw.get("text_config", raw), name)
        try:
            from splitmoe.models.families import family_for

            family_for(raw.get("model_type"), p)
        except ValueError:
            return cls._from_generic(raw, name, p)  # a family the runtime does not run (yet)
        return cls._from_family(raw, name, p)

    @classmethod
    def _from_family(cls, raw: dict, name: str, cfg_file: Path) -> ModelShape:
        from splitmoe.models.families import family_for

        # RoPE scaling changes no shape: drop what the runtime refuses (some rope types), and
        # Mistral-style windows (the runtime refuses them; their models here are sized as full
        # attention). GPT-OSS's sliding windows stay: its window layers keep 128 tokens.
        dropped = ("rope_scaling", "rope_parameters", "use_sliding_window")
        if raw.get("model_type") != "gpt_oss":
            dropped += ("sliding_window",)
        shapes_only = {k: v for k, v in raw.items() if k not in dropped}
        f = family_for(raw.get("model_type"), cfg_file).parse_config(shapes_only, cfg_file)
        return cls(
            name=name,
            hidden=f["hidden_size"],
            num_layers=f["num_layers"],
            num_moe_layers=len(f["moe_layers"]),
            vocab=f["vocab_size"],
            num_experts=f["num_experts"],
            top_k=f["top_k"],
            moe_intermediate=f["moe_intermediate_size"],
            shared_intermediate=f.get("shared_expert_intermediate_size", 0),
            dense_intermediate=f.get("dense_intermediate_size", 0),
            attention="gqa",
            num_heads=f["num_heads"],
            num_kv_heads=f["num_kv_heads"],
            head_dim=f["head_dim"],
            fp8_weights=(raw.get("quantization_config") or {}).get("quant_method") == "fp8",
            mxfp4_experts=f.get("quantization") == "mxfp4",
            sliding_window=f.get("sliding_window") or 0,
            sliding_layers=len(f.get("sliding_layers") or ()) if f.get("sliding_window") else 0,
        )

    @classmethod
    def _from_deepseek(cls, raw: dict, name: str) -> ModelShape:
        layers = int(raw["num_hidden_layers"])
        first_dense = int(raw.get("first_k_dense_replace", 0))
        freq = int(raw.get("moe_layer_freq", 1))
        moe = sum(1 for i in range(first_dense, layers) if i % freq == 0)
        inter = int(raw["moe_intermediate_size"])
        quant = (raw.get("quantization_config") or {}).get("quant_method")
        return cls(
            name=name,
            hidden=int(raw["hidden_size"]),
            num_layers=layers,
            num_moe_layers=moe,
            vocab=int(raw["vocab_size"]),
            num_experts=int(raw["n_routed_experts"]),
            top_k=int(raw["num_experts_per_tok"]),
            moe_intermediate=inter,
            shared_intermediate=inter * int(raw.get("n_shared_experts") or 0),
            dense_intermediate=int(raw.get("intermediate_size") or 0),
            attention="mla",
            num_heads=int(raw["num_attention_heads"]),
            num_kv_heads=1,
            head_dim=int(raw["kv_lora_rank"]),
            q_lora_rank=int(raw.get("q_lora_rank") or 0),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            fp8_weights=quant == "fp8",
        )

    @classmethod
    def _from_step3(cls, raw: dict, name: str) -> ModelShape:
        """StepFun Step-3 (``step3_text``, as vLLM's ``step3_text.py`` reads it): MFA attention
        (``num_attention_groups`` KV heads of ``head_dim``, a ``share_q_dim`` low-rank query),
        MoE layers listed in ``moe_layers_enum``, one shared expert of ``share_expert_dim``."""
        layers = int(raw["num_hidden_layers"])
        moe = raw.get("moe_layers_enum")
        moe_layers = (
            [int(x) for x in str(moe).split(",")] if moe is not None else list(range(layers))
        )
        return cls(
            name=name,
            hidden=int(raw["hidden_size"]),
            num_layers=layers,
            num_moe_layers=len(moe_layers),
            vocab=int(raw["vocab_size"]),
            num_experts=int(raw["moe_num_experts"]),
            top_k=int(raw["moe_top_k"]),
            moe_intermediate=int(raw["moe_intermediate_size"]),
            shared_intermediate=int(raw.get("share_expert_dim") or 0),
            dense_intermediate=int(raw.get("intermediate_size") or 0),
            attention="gqa",
            num_heads=int(raw["num_attention_heads"]),
            num_kv_heads=int(raw.get("num_attention_groups", 1)),
            head_dim=int(raw["head_dim"]),
            q_lora_rank=int(raw.get("share_q_dim") or 0),
            fp8_weights=(raw.get("quantization_config") or {}).get("quant_method") == "fp8",
        )

    @classmethod
    def _from_generic(cls, raw: dict, name: str, cfg_file: Path) -> ModelShape:
        """A MoE ``config.json`` of a family the runtime does not parse, read by the common
        Hugging Face key names (expert count, top-k, expert and shared-expert widths, dense
        layers first)."""

        def first(*keys, default=None):
            for k in keys:
                if raw.get(k) is not None:
                    return raw[k]
            if default is None:
                raise ValueError(
                    f"{cfg_file}: model_type={raw.get('model_type')!r} has none of {keys}; the "
                    "simulator needs them to size the model"
                )
            return default

        hidden = int(first("hidden_size", "d_model"))
        heads = int(first("num_attention_heads", "n_heads"))
        layers = int(first("num_hidden_layers", "n_layers"))
        experts = int(first("n_routed_experts", "num_local_experts", "num_experts",
                            "moe_num_experts"))  # fmt: skip
        inter = int(first("moe_intermediate_size", "intermediate_size"))
        dense_first = int(first("first_k_dense_replace", default=0))
        shared = int(
            first("shared_expert_intermediate_size", "shared_intermediate_size", default=0)
        )
        shared = shared or inter * int(first("n_shared_experts", default=0))
        quant = (raw.get("quantization_config") or {}).get("quant_method")
        return cls(
            name=name,
            hidden=hidden,
            num_layers=layers,
            num_moe_layers=layers - dense_first,
            vocab=int(first("vocab_size")),
            num_experts=experts,
            top_k=int(first("num_experts_per_tok", "moe_top_k", "experts_per_token")),
            moe_intermediate=inter,
            shared_intermediate=shared,
            dense_intermediate=int(first("intermediate_size", default=0)) if dense_first else 0,
            attention="gqa",
            num_heads=heads,
            num_kv_heads=int(first("num_key_value_heads", default=heads)),
            head_dim=int(first("head_dim", default=hidden // heads)),
            fp8_weights=quant == "fp8",
        )
