"""Compute kernels, each a function from tensors to tensors with a PyTorch reference, and the
backend objects (`backends`) through which the model and the expert worker call them.

* `paged_attention.paged_attention`: causal attention over the paged KV cache. Triton:
  `prefill_attention` (FlashAttention-2 for multi-token rows) and `decode_attention` (split-KV
  flash-decoding for one-token rows); `attention_tile` holds their shared online-softmax step.
* `fused_moe.fused_moe`: the grouped expert FFN. Triton: `moe_gemm` (sorted, padded grouped
  GEMMs with SiLU-and-multiply fused); on CUDA also ``torch._grouped_mm``, whichever is faster.
* `balance_cpu` (C, via ctypes) and `balance_triton`: the expert balancer's per-step replica
  choice, bit-identical to its PyTorch policy (`splitmoe.eplb.policy`).

The references are the oracle in tests; ``"triton"`` is the default on CUDA and ``"torch"`` on
CPU. Modules that import triton are imported only when that backend runs. See docs/kernels.md.
"""
