"""Checkpoint reading: sharding, per-role tensor sets, and clear errors for broken checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from small_default import write_small_model

from splitmoe.models.config import ModelConfig
from splitmoe.models.loader import (
    CheckpointError,
    CheckpointReader,
    load_attention_weights,
    load_expert_weights,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_small_model(tmp_path_factory.mktemp("small"))


def _copy(ckpt, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(ckpt, dst)
    return dst


def test_sharded_index_loads_same_tensors(ckpt, tmp_path):
    tensors = load_file(str(ckpt / "model.safetensors"))
    dst = _copy(ckpt, tmp_path)
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(dst / shard))
        weight_map.update({k: shard for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg_a, cfg_b = ModelConfig.from_hf(ckpt), ModelConfig.from_hf(dst)
    ga, la = load_attention_weights(cfg_a, torch.float32, "cpu")
    gb, lb = load_attention_weights(cfg_b, torch.float32, "cpu")
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=0, atol=0)
    for a, b in zip(la, lb):
        assert a.keys() == b.keys()
    ea = load_expert_weights(cfg_a, [1, 3], torch.float32, "cpu")
    eb = load_expert_weights(cfg_b, [1, 3], torch.float32, "cpu")
    for layer in ea:
        torch.testing.assert_close(ea[layer][0], eb[layer][0], rtol=0, atol=0)
        assert ea[layer][0].shape == (2, 2 * 16, 32) and ea[layer][1].shape == (2, 32, 16)


def test_each_role_reads_only_its_tensors(ckpt, tmp_path):
    """With every expert tensor but expert 2's removed, the attention weights and expert 2 still
    load; asking for expert 0 names the missing tensor."""
    tensors = load_file(str(ckpt / "model.safetensors"))
    dst = _copy(ckpt, tmp_path)
    kept = {k: v for k, v in tensors.items() if ".experts." not in k or ".experts.2." in k}
    save_file(kept, str(dst / "model.safetensors"))
    cfg = ModelConfig.from_hf(dst)
    load_attention_weights(cfg, torch.float32, "cpu")
    load_expert_weights(cfg, [2], torch.float32, "cpu")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj"):
        load_expert_weights(cfg, [0], torch.float32, "cpu")


def test_wrong_shape_names_tensor(ckpt, tmp_path):
    tensors = load_file(str(ckpt / "model.safetensors"))
    dst = _copy(ckpt, tmp_path)
    tensors["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(32, 16)
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"o_proj.*shape \(32, 16\).*\(32, 32\)"):
        load_attention_weights(ModelConfig.from_hf(dst), torch.float32, "cpu")


def test_truncated_shard_is_refused_naming_file(ckpt, tmp_path):
    dst = _copy(ckpt, tmp_path)
    f = dst / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        cfg = ModelConfig.from_hf(dst)
        CheckpointReader(dst)
        load_attention_weights(cfg, torch.float32, "cpu")


def test_missing_shard_in_index(ckpt, tmp_path):
    dst = _copy(ckpt, tmp_path)
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    save_file(tensors, str(dst / "model-00001-of-00002.safetensors"))
    wm = {k: "model-00001-of-00002.safetensors" for k in tensors}
    wm["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        CheckpointReader(dst)


def test_pickle_checkpoint_refused_with_conversion_hint(ckpt, tmp_path):
    dst = _copy(ckpt, tmp_path)
    (dst / "model.safetensors").unlink()
    (dst / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*save_pretrained"):
        CheckpointReader(dst)


def test_config_errors(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelConfig.from_hf(tmp_path / "nowhere")
    dst = _copy(ckpt, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type='llama'.*supported families"):
        ModelConfig.from_hf(dst)
    (dst / "config.json").write_text(
        json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"})
    )
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf(dst)
