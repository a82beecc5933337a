"""Compute kernels behind two public entries, each with a PyTorch reference and Triton kernels.

* `paged_attention.paged_attention`: causal attention over the paged KV cache. Triton:
  `prefill_attention` (FlashAttention-2 for multi-token rows) and `decode_attention` (split-KV
  flash-decoding for one-token rows); `attention_tile` holds their shared online-softmax step.
* `fused_moe.fused_moe`: the grouped expert FFN. Triton: `moe_gemm` (sorted, padded grouped
  GEMMs with SiLU-and-multiply fused); on CUDA also ``torch._grouped_mm``, whichever is faster.

The references are the oracle in tests and the default on CPU; ``backend="triton"`` is the default
on CUDA. Modules that import triton are imported only when that backend runs. See docs/kernels.md.
"""
