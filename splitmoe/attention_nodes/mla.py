"""Multi-head latent attention (DeepSeek-V2/V3) weights, prepared once at load for the absorbed
form that `AttentionModel.mla_inputs` and `attention_kernel` compute.

Per token the cache holds ``c`` (``kv_lora_rank`` values: ``kv_a_proj`` then ``kv_a_layernorm``)
and the rotary key ``k_pe`` (``qk_rope_head_dim``), shared by every head. Head ``h``'s key is
``[W_UK[h] c, k_pe]`` and its value ``W_UV[h] c`` (``kv_b_proj`` split per head), so

    q_h . k_h = (W_UK[h]^T q_nope_h) . c + q_pe_h . k_pe      (the key up-projection absorbed)
    o_h = W_UV[h] (sum_t p_t c_t)                             (the value one applied after)

and attention runs over the latent cache as one multi-query head of ``kv_lora_rank +
qk_rope_head_dim`` (values: its first ``kv_lora_rank``), as DeepSeek's inference code,
FlashMLA and vLLM's MLA backend do for decode; here prefill and extend use the same form.

Interleaved rotary layouts (DeepSeek-V2, V3 with ``rope_interleave``) rotate pairs
``(x0, x1), (x2, x3) ...``; the rows of the rotary outputs of the q and kv_a projections are
permuted here to ``(x0, x2, ..., x1, x3, ...)`` so the one half-rotation RoPE applies (the
scores are unchanged: q and k are permuted alike, and HF's interleaved form computes the same
products). FP8 projections stay FP8 (`QuantizedWeight`): the permutation keeps each row in its
scale block (`quant.permute_rows`); ``kv_b_proj``, split per head for batched GEMMs, is loaded
dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitmoe.kernels.quant import QuantizedWeight, permute_rows
from splitmoe.models.config import ModelConfig

Weight = torch.Tensor | QuantizedWeight


def deinterleave(rows: int, device) -> torch.Tensor:
    """The permutation ``0, 2, 4, ..., 1, 3, 5, ...`` of ``rows`` rotary rows."""
    return torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)]).to(device)


@dataclass
class MlaWeights:
    w_q: Weight  # [nh (nope + R), H] or, with q LoRA, [nh (nope + R), Qr]
    q_a: Weight | None  # [Qr, H] (q LoRA)
    q_a_bias: torch.Tensor | None
    q_a_norm: torch.Tensor | None  # [Qr]
    kv_a: Weight  # [Lr + R, H]
    kv_a_bias: torch.Tensor | None
    kv_a_norm: torch.Tensor  # [Lr]
    w_uk: torch.Tensor  # [nh, nope, Lr]: folds q_nope into the latent space
    w_uv_t: torch.Tensor  # [nh, Lr, v]: the latent context to each head's value
    o_bias: torch.Tensor | None

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], cfg: ModelConfig) -> MlaWeights:
        nh, nope, R, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim
        Lr = cfg.kv_lora_rank
        w_q = t["q_b_proj"] if cfg.q_lora_rank is not None else t["q_proj"]
        kv_a, kv_a_bias = t["kv_a_proj"], t.get("kv_a_bias")
        dtype = t["kv_a_norm"].dtype  # the run dtype
        if cfg.rope_interleave:
            perm = deinterleave(R, w_q.device)
            head = torch.cat([torch.arange(nope, device=perm.device), nope + perm])
            q_perm = (torch.arange(nh, device=perm.device)[:, None] * (nope + R) + head).view(-1)
            w_q = permute_rows(w_q, q_perm, dtype)  # each head's rotary rows de-interleaved
            kv_perm = torch.cat([torch.arange(Lr, device=perm.device), Lr + perm])
            kv_a = permute_rows(kv_a, kv_perm, dtype)
            if kv_a_bias is not None:
                kv_a_bias = kv_a_bias.index_select(0, kv_perm)
        kv_b = t["kv_b_proj"].view(nh, nope + v, Lr)
        return cls(
            w_q=w_q,
            q_a=t.get("q_a_proj"),
            q_a_bias=t.get("q_a_bias"),
            q_a_norm=t.get("q_a_norm"),
            kv_a=kv_a,
            kv_a_bias=kv_a_bias,
            kv_a_norm=t["kv_a_norm"],
            w_uk=kv_b[:, :nope].contiguous(),
            w_uv_t=kv_b[:, nope:].transpose(1, 2).contiguous(),
            o_bias=t.get("o_bias"),
        )
