"""Top-k expert routing of every supported family, in one place, on the attention rank.

The router turns a token's hidden state into ``k`` (expert id, weight) pairs; that is all the
balancer and the expert ranks ever see, so a family's routing is a handful of `ModelConfig`
fields read here:

* ``scoring_func``: ``"softmax"`` (Qwen, Mixtral, OLMoE, DeepSeek-V2) or ``"sigmoid"``
  (DeepSeek-V3, Kimi-K2, GLM-4.5, MiniMax-M2) over the router logits, or ``"topk_softmax"``
  (GPT-OSS: the top-k logits, then a softmax over those k, in the logits' dtype).
* the router's own bias (``router_logit_bias``, GPT-OSS): added to the logits.
* ``router_bias``: whether the checkpoint has a per-expert ``e_score_correction_bias``
  (canonical key ``"router_bias"``): added to the scores to *choose* experts only; the weights
  are the unbiased scores of the chosen ones.
* ``topk_method``: ``"greedy"`` (top-k of all experts), ``"group_limited_greedy"``
  (DeepSeek-V2: experts in ``n_group`` groups, a group scored by its best expert, only the
  ``topk_group`` best groups compete) or ``"noaux_tc"`` (DeepSeek-V3 / GLM-4.5: a group scored
  by the sum of its two best biased scores).
* ``norm_topk_prob``: the k weights renormalised to sum to one.
* ``routed_scaling_factor``: the k weights multiplied by it (after renormalisation).

This follows HF transformers' ``DeepseekV3TopkRouter``, ``DeepseekV2TopkRouter``,
``Glm4MoeTopkRouter`` and ``MiniMaxM2TopKRouter``; softmax + greedy keeps the Qwen/Mixtral
arithmetic (logits in the run dtype, softmax in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitmoe.kernels.linear import linear

SCORING_FUNCS = ("softmax", "sigmoid", "topk_softmax")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def _group_mask(choice: torch.Tensor, method: str, n_group: int, topk_group: int) -> torch.Tensor:
    """``[T, E]`` bool: experts whose group is among the ``topk_group`` best of each token."""
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)
    if method == "noaux_tc":
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    else:
        group_scores = grouped.max(dim=-1).values
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool)
    mask.scatter_(1, group_idx, True)
    return mask[:, :, None].expand(T, n_group, E // n_group).reshape(T, E)


def route(
    cfg,
    router: torch.Tensor,
    router_bias: torch.Tensor | None,
    x: torch.Tensor,
    logit_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids ``[T, k]`` (int64) and weights ``[T, k]`` (``x``'s dtype) of ``x [T, H]``
    under ``router [E, H]`` (+ ``logit_bias [E]``) (``cfg``: a
    `splitmoe.models.config.ModelConfig`)."""
    k = cfg.top_k
    if cfg.scoring_func == "topk_softmax":
        top, ids = torch.topk(F.linear(x, router, logit_bias), k, dim=-1)  # [T, k]
        return ids, top.softmax(dim=-1).to(x.dtype)
    if logit_bias is not None:
        raise ValueError(f"a router bias is only supported with topk_softmax scoring ({cfg.path})")
    if cfg.scoring_func == "softmax" and cfg.topk_method == "greedy" and router_bias is None:
        # (the gate's GEMM through `linear`: on CPU the measured fastest kernel for its shape)
        probs = linear(x, router).softmax(dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = torch.topk(probs, k, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        logits = F.linear(x.float(), router.float())  # [T, E] (HF keeps these routers in fp32)
        if cfg.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        choice = scores if router_bias is None else scores + router_bias.float()
        if cfg.topk_method != "greedy":
            mask = _group_mask(choice, cfg.topk_method, cfg.n_group, cfg.topk_group)
            choice = choice.masked_fill(~mask, float("-inf"))
        ids = torch.topk(choice, k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return ids, weights.to(x.dtype)


def check_routing(cfg) -> None:
    """Raises ValueError naming a routing setting that cannot work (called by `ModelConfig`)."""
    where = f"in {cfg.path}/config.json"
    if cfg.scoring_func not in SCORING_FUNCS:
        raise ValueError(
            f"scoring_func={cfg.scoring_func!r} {where} is not supported; "
            f"supported: {', '.join(SCORING_FUNCS)}"
        )
    if cfg.topk_method not in TOPK_METHODS:
        raise ValueError(
            f"topk_method={cfg.topk_method!r} {where} is not supported; "
            f"supported: {', '.join(TOPK_METHODS)}"
        )
    if cfg.topk_method != "greedy":
        g, tg, E = cfg.n_group, cfg.topk_group, cfg.num_experts
        if g < 1 or E % g or not 1 <= tg <= g:
            raise ValueError(
                f"n_group={g}, topk_group={tg} {where}: n_group must divide the {E} routed "
                "experts and 1 <= topk_group <= n_group"
            )
        if cfg.topk_method == "noaux_tc" and E // g < 2:
            raise ValueError(
                f"n_group={g} {where} leaves fewer than 2 experts per group, which noaux_tc "
                "routing (a group scored by its two best experts) needs"
            )
        if cfg.top_k > tg * (E // g):
            raise ValueError(
                f"num_experts_per_tok={cfg.top_k} {where} exceeds the {tg * (E // g)} experts "
                f"of the topk_group={tg} groups a token may use"
            )
