"""The released DeepSeek-V3 config.json (shipped for the simulator) parses as the runtime runs it,
and the simulator sizes its KV cache by the runtime's rule."""

from __future__ import annotations

import shutil

from splitmoe.models.config import ModelConfig
from splitmoe.sim.model import CONFIG_DIR, ModelShape


def test_deepseek_v3_config_and_cache_bytes(tmp_path):
    shutil.copy(CONFIG_DIR / "deepseek-v3.json", tmp_path / "config.json")
    cfg = ModelConfig.from_hf(tmp_path)
    assert cfg.is_mla and (cfg.kv_lora_rank, cfg.head_dim, cfg.q_lora_rank) == (512, 64, 1536)
    assert (cfg.scoring_func, cfg.topk_method, cfg.n_group, cfg.topk_group) == (
        "sigmoid", "noaux_tc", 8, 4,
    )  # fmt: skip
    assert cfg.router_bias and cfg.routed_scaling_factor == 2.5 and cfg.norm_topk_prob
    assert cfg.moe_layers == tuple(range(3, 61)) and cfg.shared_expert_intermediate_size == 2048
    assert (cfg.rope_type, dict(cfg.rope_scaling)["factor"]) == ("yarn", 40)
    assert (cfg.quantization, cfg.weight_block_size) == ("fp8", (128, 128))
    # 576 values per token and layer: 70 KB per token over 61 layers in bf16
    assert cfg.kv_values_per_token == 512 + 64
    sim = ModelShape.from_config("deepseek-v3")
    assert sim.kv_bytes_per_token(2) * cfg.num_layers == cfg.kv_bytes_per_token(2) == 70272
