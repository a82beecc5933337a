"""Checkpoints in the released quantized layouts, built from the tiny ones: MXFP4 GPT-OSS (FP8
block-quantized ones: `tiny_models.quantize_fp8_checkpoint`), and a larger FP8 expert set for
the load-memory test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from splitmoe.models.gpt_oss import quantize_mxfp4


def write_mxfp4_checkpoint(src, out) -> tuple[Path, Path]:
    """``src``'s GPT-OSS checkpoint with its experts in the released MXFP4 layout (``out /
    "mxfp4"``), and (for HF) a plain one holding the weights that layout dequantizes to, by
    transformers' own code (``out / "dequantized"``)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, out = Path(src), Path(out)
    quant, plain = out / "mxfp4", out / "dequantized"
    for d in (quant, plain):
        shutil.copytree(src, d)
    t = load_file(str(src / "model.safetensors"))
    q_t, p_t = dict(t), dict(t)
    for name in [n for n in t if n.endswith(("gate_up_proj", "down_proj"))]:
        rows = t[name].transpose(1, 2).contiguous()  # [E, out features, in features]
        blocks, scales = quantize_mxfp4(rows)
        del q_t[name]
        q_t[name + "_blocks"], q_t[name + "_scales"] = blocks, scales
        p_t[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
        assert p_t[name].shape == t[name].shape
        assert not torch.equal(p_t[name], t[name])  # rounding to FP4 changed the weights
    save_file(q_t, str(quant / "model.safetensors"), metadata={"format": "pt"})
    save_file(p_t, str(plain / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (quant / "config.json").write_text(json.dumps(cfg))
    return quant, plain


def write_fp8_experts(
    src, out, hidden: int, inter: int, experts: int, layers: int, block=(128, 128)
) -> Path:
    """A Qwen3-MoE config (``src``'s, resized) and FP8 expert tensors only, in the released
    layout (float8_e4m3fn, float32 ``weight_scale_inv`` per block), random: enough for
    `load_expert_weights`, at ``layers * experts * 3 * hidden * inter`` bytes of FP8 weights
    without building the model. Two shards, so that reads cross files."""
    out = Path(out)
    out.mkdir(parents=True)
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg.update(
        hidden_size=hidden,
        moe_intermediate_size=inter,
        num_experts=experts,
        num_hidden_layers=layers,
        mlp_only_layers=[],
        quantization_config={
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(block),
        },
    )
    (out / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    bn, bk = block
    weight_map = {}
    for layer in range(layers):
        shard = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        tensors = {}
        for e in range(experts):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            for proj, (n, k) in (
                ("gate_proj", (inter, hidden)),
                ("up_proj", (inter, hidden)),
                ("down_proj", (hidden, inter)),
            ):
                w = torch.randn(n, k, generator=g).to(torch.float8_e4m3fn)
                tensors[f"{p}.{proj}.weight"] = w
                s = torch.rand(-(-n // bn), -(-k // bk), generator=g) + 0.5
                tensors[f"{p}.{proj}.weight_scale_inv"] = s
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out
