"""Compute kernels behind two public entries, each with a PyTorch reference and Triton kernels.

* `paged_attention.paged_attention`: causal attention over the paged KV cache. Triton:
  `prefill_attention` (FlashAttention-2 for multi-token rows) and `decode_attention` (split-KV
  flash-decoding for one-token rows); `attention_tile` holds their shared online-softmax step.
* `fused_moe.fused_moe`: the grouped expert FFN. Triton: `moe_gemm` (sorted, padded grouped
  GEMMs with SiLU-and-multiply fused); on CUDA also ``torch._grouped_mm``, whichever is faster.

`cpu_native`: the ``"cpu"`` backend, plain-C kernels for float32 on CPU (decode attention over the
paged cache, RMSNorm, q/k norm + RoPE, router top-k, KV store, the routed experts), built on first
use with the system C compiler and called through ctypes.

The references are the oracle in tests; ``"triton"`` is the default on CUDA and ``"cpu"`` on CPU
in float32 where it builds (else the references). Modules that import triton are imported only
when that backend runs. See docs/kernels.md.
"""
