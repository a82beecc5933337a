"""Compute kernels: each file holds a kernel's public wrapper and its PyTorch reference.

The references are the oracle in tests and the default path on CPU. Triton kernels for CUDA
(issue: paged FlashAttention and fused MoE) slot in behind the same wrappers.
"""
