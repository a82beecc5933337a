"""Streaming weight loading from safetensors checkpoints.

Each role asks for exactly the tensors it owns; a `CheckpointReader` finds which shard holds each
name (from ``model.safetensors.index.json`` or the shards' headers), reads only those tensors, and
checks every shape against `ModelConfig`. Only safetensors are read: no checkpoint code runs.

FP8 block-quantized projections (routed and shared experts, dense MLPs, attention projections)
stay in their released layout as `QuantizedWeight` (see `splitmoe.kernels.quant`), scales beside
them. Tensors are read with plain file reads straight into their final place (the stacked
expert tensors are allocated once, each expert read into its slot): no memory-mapped copy of the
shard and no list of per-expert tensors, so memory while loading stays at the resident size.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import torch

from splitmoe.kernels.quant import FP8_DTYPES, QuantizedWeight, dequantize_fp8
from splitmoe.models import gpt_oss
from splitmoe.models.config import ModelConfig
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


def dequantize_fp8_blocks(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``w [N, K]`` float8 times its per-block scale ``scale_inv [ceil(N / bn), ceil(K / bk)]``
    (DeepSeek-V3's ``weight_dequant``), float32."""
    try:
        return dequantize_fp8(w, scale_inv, block)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


# Canonical keys kept FP8 on attention ranks when the checkpoint stores them so: the projections
# `linear` runs. ``kv_b_proj`` is not: MLA splits it into per-head matrices for batched GEMMs
# (`attention_nodes.mla`), so it is dequantized at load (nh (nope + v) x kv_lora_rank, a few
# percent of an MLA layer's attention bytes).
QUANTIZED_KEYS = frozenset(
    {
        "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj",
        "mlp_gate", "mlp_up", "mlp_down", "shared_gate", "shared_up", "shared_down",
    }
)  # fmt: skip

# safetensors dtype names
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}  # fmt: skip
_SIZED = frozenset(_DTYPES.values())


class _Shard:
    """One safetensors file: its header parsed and checked against the file's size; tensors (or
    rows of one) read with ``os.pread`` into a given tensor, so nothing but the destination
    holds the bytes (a memory-mapped read would keep the shard's pages resident too)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                if n < 2 or 8 + n > size:
                    raise ValueError(f"header length {n} does not fit a {size}-byte file")
                header = json.loads(f.read(n))
            self.start = 8 + n
            # name -> (dtype, or the header's name of one torch lacks; shape; file offset)
            self.entries: dict[str, tuple[torch.dtype | str, tuple[int, ...], int]] = {}
            for name, e in header.items():
                if name == "__metadata__":
                    continue
                dtype = _DTYPES.get(e["dtype"], e["dtype"])
                shape = tuple(int(d) for d in e["shape"])
                begin, end = (int(o) for o in e["data_offsets"])
                # (a dtype torch lacks is refused only if the tensor is read: `_entry`)
                want = dtype.itemsize * int(torch.Size(shape).numel()) if dtype in _SIZED else 0
                if (want and end - begin != want) or not 0 <= begin <= end <= size - self.start:
                    raise ValueError(f"tensor {name!r} lies outside the file or has a bad size")
                self.entries[name] = (dtype, shape, self.start + begin)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"cannot read {path}: {e} (the file may be truncated or corrupt; re-download it)"
            ) from None

    def read_into(self, name: str, out: torch.Tensor, rows: list[int] | None = None) -> None:
        """Tensor ``name`` (or its first-dim ``rows``, in order) into ``out``: contiguous CPU, of
        the stored dtype and shape (with ``rows``: ``len(rows)`` leading rows)."""
        dtype, shape, offset = self.entries[name]
        buf = memoryview(out.view(torch.uint8).numpy()).cast("B") if out.numel() else None
        if buf is None:
            return
        row = dtype.itemsize * int(torch.Size(shape[1:]).numel())
        spans = [(offset, 0, len(buf))] if rows is None else [
            (offset + r * row, i * row, row) for i, r in enumerate(rows)
        ]  # fmt: skip
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for src, dst, n in spans:
                while n:
                    got = os.preadv(fd, [buf[dst : dst + n]], src)
                    if got <= 0:
                        raise OSError(f"{self.path} ended early while reading {name!r}")
                    src, dst, n = src + got, dst + got, n - got
        finally:
            os.close(fd)


class CheckpointReader:
    """Finds and reads named tensors of an HF safetensors checkpoint directory. With
    ``fp8_block`` (block-quantized checkpoints), a float8 ``X.weight`` is read with its
    ``X.weight_scale_inv``: kept as a `QuantizedWeight` where the caller asks, else
    dequantized."""

    def __init__(self, path: str | Path, fp8_block: tuple[int, int] | None = None):
        self.root = Path(path)
        self.fp8_block = fp8_block
        self._shards: dict[Path, _Shard] = {}
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
            for name in self._open(shard).entries:
                out[name] = shard
        return out

    def _open(self, shard: Path) -> _Shard:
        if shard not in self._shards:
            self._shards[shard] = _Shard(shard)
        return self._shards[shard]

    def _entry(self, name: str) -> tuple[_Shard, torch.dtype, tuple[int, ...]]:
        if name not in self.weight_map:
            raise CheckpointError(
                f"checkpoint {self.root} lacks tensor {name!r} that its config.json implies; "
                "is config.json from the same model as the weights?"
            )
        shard = self._open(self.weight_map[name])
        if name not in shard.entries:
            raise CheckpointError(f"{shard.path} does not hold tensor {name!r} its index names")
        dtype, shape, _ = shard.entries[name]
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"tensor {name!r} in {shard.path} has dtype {dtype!r}, unknown")
        return shard, dtype, shape

    def _check_shape(self, name: str, have: tuple[int, ...], shape: tuple[int, ...]) -> None:
        if tuple(have) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} in {self.weight_map[name].name} has shape {tuple(have)}, but "
                f"config.json implies {tuple(shape)}"
            )

    def _read_into(self, name: str, out: torch.Tensor, rows: list[int] | None = None) -> None:
        """Reads ``name`` (its stored dtype) into ``out`` (any device and dtype; a CPU
        contiguous tensor of the stored dtype is read into directly, else through one
        temporary of the tensor's size)."""
        shard, dtype, shape = self._entry(name)
        direct = out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()
        tmp = out if direct else torch.empty(out.shape, dtype=dtype)
        try:
            shard.read_into(name, tmp, rows)
        except OSError as e:
            raise CheckpointError(
                f"cannot read tensor {name!r} from {shard.path}: {e} (truncated or corrupt?)"
            ) from None
        if not direct:
            out.copy_(tmp)

    def is_fp8(self, name: str) -> bool:
        """Whether tensor ``name`` is stored in float8 (to be read with its block scales)."""
        return self._entry(name)[1] in FP8_DTYPES

    def fp8_scale_name(self, name: str) -> str:
        scale_name = name + "_scale_inv"
        if self.fp8_block is None or scale_name not in self.weight_map:
            raise CheckpointError(
                f"tensor {name!r} is float8 but "
                + (
                    "config.json has no fp8 quantization_config"
                    if self.fp8_block is None
                    else f"the checkpoint has no {scale_name!r} to dequantize it with"
                )
            )
        return scale_name

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | QuantizedWeight:
        """Tensor ``name`` as stored, which must have ``shape``; a float8 one with its block
        scales as a `QuantizedWeight` (on the CPU)."""
        _, dtype, have = self._entry(name)
        self._check_shape(name, have, shape)
        t = torch.empty(have, dtype=dtype)
        self._read_into(name, t)
        if dtype not in FP8_DTYPES:
            return t
        scale_name, want = self._fp8_scale(name, shape)
        scale = torch.empty(want, dtype=torch.float32)
        self._read_into(scale_name, scale)
        return QuantizedWeight(t, scale, "fp8", self.fp8_block)

    def _fp8_scale(self, name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, int]]:
        """The name and shape of float8 ``name``'s block scales, checked."""
        scale_name = self.fp8_scale_name(name)
        _, _, have = self._entry(scale_name)
        bn, bk = self.fp8_block
        want = (-(-shape[0] // bn), -(-shape[1] // bk))
        if tuple(have) != want:
            raise CheckpointError(
                f"{scale_name!r} has shape {tuple(have)}, but a {tuple(shape)} weight in "
                f"{bn}x{bk} blocks (config.json's weight_block_size) needs {want}"
            )
        return scale_name, want

    def read_weight(
        self, name: str, shape: tuple[int, ...], out: torch.Tensor | QuantizedWeight
    ) -> None:
        """Tensor ``name``, which must have ``shape``, into ``out`` in place (a slot of a
        stacked tensor): a dense tensor (converted to its dtype; float8 dequantized), or a
        float8 `QuantizedWeight` whose data and block scales are read straight in."""
        _, dtype, have = self._entry(name)
        self._check_shape(name, have, shape)
        if isinstance(out, QuantizedWeight):
            if dtype != out.data.dtype:
                raise CheckpointError(
                    f"tensor {name!r} is {dtype}, unlike the first expert of its layer "
                    f"({out.data.dtype}): mixed expert dtypes are not supported"
                )
            self._read_into(name, out.data)
            self._read_into(self._fp8_scale(name, shape)[0], out.scale)
        elif dtype in FP8_DTYPES:
            out.copy_(self.get(name, shape).dequantize(torch.float32))
        else:
            self._read_into(name, out)

    def load(
        self,
        wanted: dict[str, tuple[str, tuple[int, ...]]],
        dtype: torch.dtype,
        device: str,
        quantized: frozenset[str] | set[str] = frozenset(),
    ) -> dict[str, torch.Tensor | QuantizedWeight]:
        """Reads ``{key: (checkpoint_name, expected_shape)}``; each must exist with that shape.
        A float8 tensor whose key (past its last ``.``) is in ``quantized`` stays a
        `QuantizedWeight`; any other is dequantized to ``dtype``."""
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
        out: dict[str, torch.Tensor | QuantizedWeight] = {}
        for keys in by_shard.values():
            for key in keys:
                name, shape = wanted[key]
                t = self.get(name, shape)
                if isinstance(t, QuantizedWeight):
                    if key.rsplit(".", 1)[-1] in quantized:
                        out[key] = t.to(device)
                        continue
                    t = t.dequantize(torch.float32)
                # HF keeps the routers' correction biases in float32 whatever the run dtype
                keep = key.endswith(ROUTER_BIAS_KEY) and t.is_floating_point()
                out[key] = t.to(device=device, dtype=torch.float32 if keep else dtype)
        return out

    def rows(self, name: str, rows: list[int], shape: tuple[int, ...]) -> torch.Tensor:
        """Rows ``rows`` (first dim) of tensor ``name``, which must have ``shape``, as stored
        ``[len(rows), *shape[1:]]``: only those rows are read (a fused expert tensor's listed
        experts)."""
        _, dtype, have = self._entry(name)
        self._check_shape(name, have, shape)
        out = torch.empty(len(rows), *have[1:], dtype=dtype)
        self._read_into(name, out, rows)
        return out


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
    flat = reader.load(wanted, dtype, device, quantized=QUANTIZED_KEYS)
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
    I = cfg.moe_intermediate_size
    out = {}
    for layer, listed in per_layer.items():
        names = [{k: fam.expert_name(layer, e, k) for k in ("gate", "up", "down")} for e in listed]
        fp8 = bool(listed) and reader.is_fp8(names[0]["gate"])
        if fp8 and I % reader.fp8_block[0]:
            raise CheckpointError(
                f"FP8 experts with moe_intermediate_size {I} and {reader.fp8_block[0]}-row "
                "blocks (weight_block_size): gate and up stack into one block-scaled w13 only "
                "when the size is a multiple of the block rows (true of the released FP8 "
                "checkpoints)"
            )
        w13 = _empty_stack(reader, len(listed), (2 * I, cfg.hidden_size), fp8, dtype, device)
        w2 = _empty_stack(reader, len(listed), (cfg.hidden_size, I), fp8, dtype, device)
        first: dict[int, int] = {}  # expert -> the slot that read it
        for slot, e in enumerate(listed):
            if e in first:  # a replica: copy the slot already read
                _copy_slot(w13, slot, first[e])
                _copy_slot(w2, slot, first[e])
                continue
            first[e] = slot
            for k, dst, row in (("gate", w13, 0), ("up", w13, I), ("down", w2, 0)):
                shape = expected_shape(cfg, k)
                reader.read_weight(names[slot][k], shape, _rows(dst, slot, row, shape[0]))
        out[layer] = (w13, w2)
    return out


def _empty_stack(
    reader: CheckpointReader,
    n: int,
    shape: tuple[int, int],
    fp8: bool,
    dtype: torch.dtype,
    device: str,
) -> torch.Tensor | QuantizedWeight:
    """``n`` weights of logical ``shape [N, K]``, allocated once and filled slot by slot: dense
    in ``dtype``, or with ``fp8`` float8 data and float32 block scales."""
    if not fp8:
        return torch.empty(n, *shape, dtype=dtype, device=device)
    if reader.fp8_block is None:
        raise CheckpointError(
            "float8 expert weights but config.json has no fp8 quantization_config"
        )
    (N, K), (bn, bk) = shape, reader.fp8_block
    data = torch.empty(n, N, K, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(n, -(-N // bn), -(-K // bk), dtype=torch.float32, device=device)
    return QuantizedWeight(data, scale, "fp8", (bn, bk))


def _rows(
    w: torch.Tensor | QuantizedWeight, slot: int, row: int, n: int
) -> torch.Tensor | QuantizedWeight:
    """Rows ``row : row + n`` of slot ``slot`` of a stack, a view (float8: its scale rows too;
    ``row`` and ``n`` are whole blocks, which `load_expert_weights` checked)."""
    if not isinstance(w, QuantizedWeight):
        return w[slot, row : row + n]
    bn = w.block[0]
    scale = w.scale[slot, row // bn : -(-(row + n) // bn)]
    return QuantizedWeight(w.data[slot, row : row + n], scale, w.fmt, w.block)


def _copy_slot(dst: torch.Tensor | QuantizedWeight, slot: int, src: int) -> None:
    for t in (dst.data, dst.scale) if isinstance(dst, QuantizedWeight) else (dst,):
        t[slot].copy_(t[src])
