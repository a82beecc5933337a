"""GPT-OSS's experts (biases on both projections, the clamped SwiGLU) in every MoE backend
against transformers' own ``GptOssExperts`` on the same weights (its fused ``[E, H, 2I]``
interleaved layout converted as the loader converts it)."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from tiny_models import require_hf_swiglu_config

import splitmoe.kernels.fused_moe as fm
from splitmoe.kernels.fused_moe import fused_moe

E, H, I, N, K = 6, 32, 16, 11, 2
LIMIT, ALPHA = 0.6, 1.702


def _hf_experts(seed: int = 0):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(
        hidden_size=H, intermediate_size=I, num_local_experts=E, swiglu_limit=LIMIT,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    m = GptOssExperts(cfg)
    require_hf_swiglu_config(cfg, [m])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return m


def _canonical(m):
    gu, bgu = m.gate_up_proj.detach(), m.gate_up_proj_bias.detach()  # [E, H, 2I], [E, 2I]
    w13 = torch.cat([gu[..., 0::2], gu[..., 1::2]], -1).transpose(1, 2).contiguous()
    b13 = torch.cat([bgu[:, 0::2], bgu[:, 1::2]], -1).contiguous()
    w2 = m.down_proj.detach().transpose(1, 2).contiguous()  # [E, H, I]
    return w13, w2, b13, m.down_proj_bias.detach().contiguous()


# the torch backend on CPU with each of `fused_moe_cpu`'s GEMM paths forced
BACKENDS = ["torch-per_expert", "torch-wleft", "torch-xleft"]
if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
    BACKENDS.append("triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_transformers_experts(backend, monkeypatch):
    if backend.startswith("torch-"):
        backend, path = backend.split("-", 1)
        forced = functools.partial(fm.fused_moe_cpu, path=path)
        monkeypatch.setitem(fm.MOE_KERNELS, "torch", forced)
    m = _hf_experts()
    g = torch.Generator().manual_seed(1)
    x = 2.0 * torch.randn(N, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    w = torch.rand(N, K, generator=g).softmax(-1)
    with torch.no_grad():
        want = m(x, ids, w)
    w13, w2, b13, b2 = _canonical(m)
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    x, w13, w2, b13, b2, ids, w = (t.to(dev) for t in (x, w13, w2, b13, b2, ids, w))
    want = want.to(dev)
    ffn = dict(b13=b13, b2=b2, swiglu_limit=LIMIT, swiglu_alpha=ALPHA)
    got = fused_moe(x, w13, w2, ids.to(torch.int32), w, backend=backend, **ffn)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the clamp is reached (else the test could not tell the two SwiGLUs apart)
    plain = fused_moe(x, w13, w2, ids.to(torch.int32), w, backend=backend, b13=b13, b2=b2)
    assert (plain - want).abs().max() > 1e-2
    # slots served elsewhere (-1) drop out, biases included
    part = ids.to(torch.int32).clone()
    part[:, 1] = -1
    got = fused_moe(x, w13, w2, part, w, backend=backend, **ffn)
    with torch.no_grad():
        want = m(x.cpu(), ids[:, :1].cpu(), w[:, :1].cpu()).to(dev)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
