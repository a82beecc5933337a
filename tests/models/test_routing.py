"""`splitmoe.models.routing` against HF transformers' routers, family by family: the same
experts chosen and the same weights, in float32 (random routers, non-zero correction biases)."""

from __future__ import annotations

import pytest
import torch

from splitmoe.models.config import ModelConfig
from splitmoe.models.routing import route

E, H, T = 16, 32, 64


def model_config(**routing) -> ModelConfig:
    base = dict(
        path="/tiny", model_type="deepseek_v3", vocab_size=8, hidden_size=H, num_layers=1,
        num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=64, num_experts=E, moe_intermediate_size=8, moe_layers=(0,),
        norm_topk_prob=True,
    )  # fmt: skip
    return ModelConfig(**dict(base, **routing))


def hf_router(family: str, **cfg):
    """(router module, forward(x) -> (weights, ids)) of HF's router for ``family``."""
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        m = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=H, n_routed_experts=E, **cfg))
    elif family == "deepseek_v2":
        from transformers import DeepseekV2Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        m = DeepseekV2TopkRouter(DeepseekV2Config(hidden_size=H, n_routed_experts=E, **cfg))
    elif family == "glm4_moe":
        from transformers import Glm4MoeConfig
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

        m = Glm4MoeTopkRouter(Glm4MoeConfig(hidden_size=H, n_routed_experts=E, **cfg))
    else:
        from transformers import MiniMaxM2Config
        from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

        m = MiniMaxM2TopKRouter(MiniMaxM2Config(hidden_size=H, num_local_experts=E, **cfg))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        m.weight.copy_(torch.randn(E, H, generator=g) * 0.3)
    bias = torch.randn(E, generator=g) * 0.2  # non-zero: HF initialises it to zeros
    if family == "minimax_m2":  # its bias lives on the MoE block and is passed in

        def fwd(x):
            return m(x, bias)[1:]
    else:
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.copy_(bias)

        def fwd(x):
            return m(x)[1:]

    return m, bias, fwd


CASES = {
    "deepseek_v3": (
        dict(n_group=4, topk_group=2, num_experts_per_tok=3, routed_scaling_factor=2.5),
        dict(scoring_func="sigmoid", router_bias=True, topk_method="noaux_tc", n_group=4,
             topk_group=2, top_k=3, norm_topk_prob=True, routed_scaling_factor=2.5),
    ),
    "kimi_k2": (  # deepseek_v3 with one group
        dict(n_group=1, topk_group=1, num_experts_per_tok=4, routed_scaling_factor=2.827),
        dict(scoring_func="sigmoid", router_bias=True, topk_method="noaux_tc", n_group=1,
             topk_group=1, top_k=4, norm_topk_prob=True, routed_scaling_factor=2.827),
    ),
    "deepseek_v2": (
        dict(topk_method="greedy", num_experts_per_tok=3, routed_scaling_factor=16.0),
        dict(topk_method="greedy", top_k=3, norm_topk_prob=False, routed_scaling_factor=16.0,
             n_group=1, topk_group=1),
    ),
    "deepseek_v2_grouped": (
        dict(topk_method="group_limited_greedy", n_group=8, topk_group=3, num_experts_per_tok=4,
             routed_scaling_factor=16.0),
        dict(topk_method="group_limited_greedy", n_group=8, topk_group=3, top_k=4,
             norm_topk_prob=False, routed_scaling_factor=16.0),
    ),
    "glm4_moe": (
        dict(n_group=2, topk_group=1, num_experts_per_tok=4, routed_scaling_factor=1.8,
             norm_topk_prob=True),
        dict(scoring_func="sigmoid", router_bias=True, topk_method="noaux_tc", n_group=2,
             topk_group=1, top_k=4, norm_topk_prob=True, routed_scaling_factor=1.8),
    ),
    "minimax_m2": (
        dict(num_experts_per_tok=4),
        dict(scoring_func="sigmoid", router_bias=True, top_k=4, norm_topk_prob=True),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_route_matches_hf(case):
    hf_cfg, ours = CASES[case]
    family = {"kimi_k2": "deepseek_v3", "deepseek_v2_grouped": "deepseek_v2"}.get(case, case)
    m, bias, hf = hf_router(family, **hf_cfg)
    cfg = model_config(**ours)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_w, want_ids = hf(x)
    ids, w = route(cfg, m.weight.detach(), bias if cfg.router_bias else None, x)
    # the same (expert, weight) pairs, whatever order each side lists them in
    order, want_order = ids.sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values)
    assert torch.equal(w.gather(1, order.indices), want_w.gather(1, want_order.indices))
    if cfg.router_bias:  # the bias chose differently from the unbiased scores somewhere
        _, unbiased = route(cfg, m.weight.detach(), torch.zeros(E), x)
        assert not torch.equal(unbiased.sort(-1).values, order.values)


def test_grouping_limits_choice():
    """noaux_tc: every chosen expert lies in one of the topk_group best groups."""
    cfg = model_config(scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=1,
                       top_k=3)  # fmt: skip
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    ids, _ = route(cfg, torch.randn(E, H), None, x)
    assert ((ids // (E // 4)) == (ids[:, :1] // (E // 4))).all()


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(scoring_func="tanh"), "scoring_func='tanh'"),
        (dict(topk_method="weird"), "topk_method='weird'"),
        (dict(topk_method="noaux_tc", n_group=3, topk_group=1), "n_group=3"),
        (dict(topk_method="noaux_tc", n_group=4, topk_group=1, top_k=5), "num_experts_per_tok=5"),
    ],
)
def test_bad_routing_config(bad, match):
    with pytest.raises(ValueError, match=match):
        model_config(**dict(dict(top_k=2), **bad))
