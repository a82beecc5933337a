"""Streaming weight loading from safetensors checkpoints.

Each role asks for exactly the tensors it owns; a `CheckpointReader` finds which shard holds each
name (from ``model.safetensors.index.json`` or the shards' headers), reads only those tensors, and
checks every shape against `ModelConfig`. Only safetensors are read: no checkpoint code runs.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from splitmoe.config import ModelConfig
from splitmoe.models import gpt_oss
from splitmoe.models.families import (
    ATTENTION_KEYS,
    BIAS_KEYS,
    DENSE_KEYS,
    MLA_BIAS_KEYS,
    MLA_KEYS,
    MLA_Q_LORA_KEYS,
    QK_NORM_KEYS,
    ROUTER_BIAS_KEY,
    ROUTER_KEY,
    SHARED_GATE_KEY,
    SHARED_KEYS,
    SINK_KEYS,
    family_for,
)


class CheckpointError(ValueError):
    """A checkpoint is missing a tensor, has a wrong shape, or a broken shard."""


def expected_shape(cfg: ModelConfig, key: str) -> tuple[int, ...]:
    """Shape of a canonical tensor (see `splitmoe.models.families`) for this config."""
    H, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    Im, Id, Is = (
        cfg.moe_intermediate_size,
        cfg.dense_intermediate_size,
        cfg.shared_expert_intermediate_size,
    )
    full = cfg.qk_norm == "full"
    if cfg.is_mla and key in _MLA_SHAPE_KEYS:
        return mla_shape(cfg, key)
    return {
        "embed": (cfg.vocab_size, H),
        "lm_head": (cfg.vocab_size, H),
        "final_norm": (H,),
        "input_norm": (H,),
        "post_norm": (H,),
        "q_proj": (q, H),
        "k_proj": (kv, H),
        "v_proj": (kv, H),
        "o_proj": (H, q),
        "q_bias": (q,),
        "k_bias": (kv,),
        "v_bias": (kv,),
        "q_norm": (q,) if full else (d,),
        "k_norm": (kv,) if full else (d,),
        "router": (cfg.num_experts, H),
        "router_bias": (cfg.num_experts,),
        "mlp_gate": (Id, H),
        "mlp_up": (Id, H),
        "mlp_down": (H, Id),
        "shared_gate": (Is, H),
        "shared_up": (Is, H),
        "shared_down": (H, Is),
        "shared_expert_gate": (1, H),
        "gate": (Im, H),
        "up": (Im, H),
        "down": (H, Im),
        "o_bias": (H,),
        "sinks": (cfg.num_heads,),
        "router_logit_bias": (cfg.num_experts,),
    }[key]


_MLA_SHAPE_KEYS = (
    "q_proj", "q_a_proj", "q_a_bias", "q_a_norm", "q_b_proj", "kv_a_proj", "kv_a_bias",
    "kv_a_norm", "kv_b_proj", "o_proj", "o_bias",
)  # fmt: skip


def mla_shape(cfg: ModelConfig, key: str) -> tuple[int, ...]:
    """Shape of a multi-head latent attention tensor (`MLA_KEYS`)."""
    H, nh, R = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    qk = nh * (cfg.qk_nope_head_dim + R)
    Lr, Qr = cfg.kv_lora_rank, cfg.q_lora_rank
    return {
        "q_proj": (qk, H),
        "q_a_proj": (Qr, H),
        "q_a_bias": (Qr,),
        "q_a_norm": (Qr,),
        "q_b_proj": (qk, Qr),
        "kv_a_proj": (Lr + R, H),
        "kv_a_bias": (Lr + R,),
        "kv_a_norm": (Lr,),
        "kv_b_proj": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), Lr),
        "o_proj": (H, nh * cfg.v_head_dim),
        "o_bias": (H,),
    }[key]


def attention_layer_keys(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    """Canonical tensors an attention rank holds for one layer."""
    if cfg.is_mla:
        keys = list(MLA_KEYS)
        keys += MLA_Q_LORA_KEYS if cfg.q_lora_rank is not None else ("q_proj",)
        if cfg.attention_bias:
            keys += MLA_BIAS_KEYS
            if cfg.q_lora_rank is not None:
                keys.append("q_a_bias")
    else:
        keys = list(ATTENTION_KEYS)
    if cfg.qkv_bias:
        keys += BIAS_KEYS
    if cfg.qk_norm != "none":
        keys += QK_NORM_KEYS
    if cfg.o_bias:
        keys.append("o_bias")
    if cfg.attention_sinks:
        keys += SINK_KEYS
    if cfg.is_moe_layer[layer]:
        keys.append(ROUTER_KEY)
        if cfg.router_bias:
            keys.append(ROUTER_BIAS_KEY)
        if cfg.router_logit_bias:
            keys.append("router_logit_bias")
        if cfg.shared_expert_intermediate_size:
            keys += SHARED_KEYS
        if cfg.shared_expert_gate:
            keys.append(SHARED_GATE_KEY)
    else:
        keys += DENSE_KEYS
    return tuple(keys)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_fp8_blocks(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``w [N, K]`` float8 times its per-block scale ``scale_inv [ceil(N / bn), ceil(K / bk)]``
    (DeepSeek-V3's ``weight_dequant``), float32."""
    bn, bk = block
    N, K = w.shape
    if scale_inv.shape != (-(-N // bn), -(-K // bk)):
        raise CheckpointError(
            f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not fit a {N}x{K} weight "
            f"in {bn}x{bk} blocks"
        )
    s = scale_inv.float().repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return w.float() * s


class CheckpointReader:
    """Finds and reads named tensors of an HF safetensors checkpoint directory. With
    ``fp8_block`` (block-quantized checkpoints), a float8 ``X.weight`` is read with its
    ``X.weight_scale_inv`` and dequantized."""

    def __init__(self, path: str | Path, fp8_block: tuple[int, int] | None = None):
        self.root = Path(path)
        self.fp8_block = fp8_block
        self.weight_map = self._build_weight_map()

    def _build_weight_map(self) -> dict[str, Path]:
        index = self.root / "model.safetensors.index.json"
        if index.is_file():
            try:
                mapping = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
            out = {name: self.root / shard for name, shard in mapping.items()}
            missing = sorted({str(p.name) for p in out.values() if not p.is_file()})
            if missing:
                raise CheckpointError(
                    f"{index} lists shard(s) {missing} that are not in {self.root}; "
                    "copy the missing files or re-download the checkpoint"
                )
            return out
        shards = sorted(self.root.glob("*.safetensors"))
        if not shards:
            pickled = sorted(p.name for p in self.root.glob("*.bin")) + sorted(
                p.name for p in self.root.glob("*.pt")
            )
            hint = (
                f" It holds pickle-based weights ({', '.join(pickled[:3])}), which splitmoe "
                "does not load because unpickling can run arbitrary code; convert them once with "
                "`transformers`: AutoModelForCausalLM.from_pretrained(dir)"
                ".save_pretrained(out_dir, safe_serialization=True)."
                if pickled
                else ""
            )
            raise CheckpointError(f"no *.safetensors weights in {self.root}.{hint}")
        out: dict[str, Path] = {}
        for shard in shards:
            for name in self._open(shard).keys():
                out[name] = shard
        return out

    @staticmethod
    def _open(shard: Path):
        try:
            return safe_open(str(shard), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(
                f"cannot read {shard}: {e} (the file may be truncated or corrupt; re-download it)"
            ) from None

    def load(
        self, wanted: dict[str, tuple[str, tuple[int, ...]]], dtype: torch.dtype, device: str
    ) -> dict[str, torch.Tensor]:
        """Reads ``{key: (checkpoint_name, expected_shape)}``; each must exist with that shape."""
        missing = [name for name, _ in wanted.values() if name not in self.weight_map]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(
                f"checkpoint {self.root} lacks tensor(s) {missing[:5]}{more} that its config.json "
                "implies; is config.json from the same model as the weights?"
            )
        by_shard: dict[Path, list[str]] = defaultdict(list)
        for key, (name, _) in wanted.items():
            by_shard[self.weight_map[name]].append(key)
        out: dict[str, torch.Tensor] = {}
        for shard, keys in by_shard.items():
            f = self._open(shard)
            for key in keys:
                name, shape = wanted[key]
                try:
                    t = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(
                        f"cannot read tensor {name!r} from {shard}: {e} (truncated or corrupt?)"
                    ) from None
                if t.dtype in FP8_DTYPES:
                    t = self._dequantize(name, t)
                if tuple(t.shape) != tuple(shape):
                    raise CheckpointError(
                        f"tensor {name!r} in {shard.name} has shape {tuple(t.shape)}, but "
                        f"config.json implies {tuple(shape)}"
                    )
                # HF keeps the routers' correction biases in float32 whatever the run dtype
                keep = key.endswith(ROUTER_BIAS_KEY) and t.is_floating_point()
                out[key] = t.to(device=device, dtype=torch.float32 if keep else dtype)
        return out

    def _dequantize(self, name: str, t: torch.Tensor) -> torch.Tensor:
        scale_name = name + "_scale_inv"
        if self.fp8_block is None or scale_name not in self.weight_map:
            raise CheckpointError(
                f"tensor {name!r} is {t.dtype} but "
                + (
                    "config.json has no fp8 quantization_config"
                    if self.fp8_block is None
                    else f"the checkpoint has no {scale_name!r} to dequantize it with"
                )
            )
        scale = self._open(self.weight_map[scale_name]).get_tensor(scale_name)
        return dequantize_fp8_blocks(t, scale, self.fp8_block)

    def rows(self, name: str, rows: list[int], shape: tuple[int, ...]) -> torch.Tensor:
        """Rows ``rows`` (first dim) of tensor ``name``, which must have ``shape``, as stored
        (dtype kept): only those rows are read (a fused expert tensor's listed experts)."""
        if name not in self.weight_map:
            raise CheckpointError(
                f"checkpoint {self.root} lacks tensor {name!r} that its config.json implies; "
                "is config.json from the same model as the weights?"
            )
        shard = self.weight_map[name]
        try:
            sl = self._open(shard).get_slice(name)
            have = tuple(sl.get_shape())
            if have != tuple(shape):
                raise CheckpointError(
                    f"tensor {name!r} in {shard.name} has shape {have}, but config.json implies "
                    f"{tuple(shape)}"
                )
            return torch.stack([sl[r] for r in rows]) if rows else torch.empty(0, *shape[1:])
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"cannot read tensor {name!r} from {shard}: {e} (truncated or corrupt?)"
            ) from None


def reader_for(cfg: ModelConfig) -> CheckpointReader:
    return CheckpointReader(cfg.path, cfg.weight_block_size if cfg.quantization == "fp8" else None)


def load_attention_weights(
    cfg: ModelConfig, dtype: torch.dtype, device: str
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Non-expert weights: (globals ``embed``/``final_norm``/``lm_head``, one dict per layer)."""
    fam = family_for(cfg.model_type)
    reader = reader_for(cfg)
    glob_keys = ["embed", "final_norm"]
    if not cfg.tie_word_embeddings:
        glob_keys.append("lm_head")
    wanted = {k: (fam.global_name(k), expected_shape(cfg, k)) for k in glob_keys}
    for layer in range(cfg.num_layers):
        for k in attention_layer_keys(cfg, layer):
            wanted[f"{layer}.{k}"] = (fam.layer_name(layer, k), expected_shape(cfg, k))
    flat = reader.load(wanted, dtype, device)
    if cfg.tie_word_embeddings:
        flat["lm_head"] = flat["embed"]
    globals_ = {k: flat.pop(k) for k in ("embed", "final_norm", "lm_head")}
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.num_layers)]
    for key, t in flat.items():
        layer, k = key.split(".", 1)
        layers[int(layer)][k] = t
    return globals_, layers


def load_expert_weights(
    cfg: ModelConfig,
    experts: list[int] | dict[int, list[int]],
    dtype: torch.dtype,
    device: str,
) -> dict[int, tuple[torch.Tensor, ...]]:
    """Only the listed experts, stacked per MoE layer as ``w13 [n, 2*I, H]`` (gate rows then up
    rows) and ``w2 [n, H, I]``, and with ``cfg.expert_bias`` their biases ``b13 [n, 2*I]`` and
    ``b2 [n, H]`` too. ``experts``: one list for every MoE layer, or per layer (only the
    layers given are loaded; an expert may appear more than once)."""
    fam = family_for(cfg.model_type)
    reader = reader_for(cfg)
    per_layer = (
        experts if isinstance(experts, dict) else {layer: experts for layer in cfg.moe_layers}
    )
    if fam.fused_experts:
        return gpt_oss.load_experts(reader, cfg, per_layer, dtype, device)
    wanted = {}
    for layer, listed in per_layer.items():
        for e in set(listed):
            for k in ("gate", "up", "down"):
                wanted[f"{layer}.{e}.{k}"] = (fam.expert_name(layer, e, k), expected_shape(cfg, k))
    flat = reader.load(wanted, dtype, device)
    out = {}
    for layer, listed in per_layer.items():
        w13 = torch.stack(
            [torch.cat([flat[f"{layer}.{e}.gate"], flat[f"{layer}.{e}.up"]], 0) for e in listed]
        )  # [n, 2I, H]
        w2 = torch.stack([flat[f"{layer}.{e}.down"] for e in listed])  # [n, H, I]
        out[layer] = (w13, w2)
    return out
