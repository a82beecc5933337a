"""FP8 and MXFP4 weights resident as released: `QuantizedWeight`, the CPU kernels that read it
(exactly the dense math on the dequantized weights), the loader (bytes, values, load peak)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from quant_models import write_fp8_experts, write_mxfp4_checkpoint
from tiny_models import quantize_fp8_checkpoint

from splitmoe.expert_nodes.experts import LocalExperts
from splitmoe.kernels.backends import moe_backend
from splitmoe.kernels.fused_moe import cpu_moe_decision, fused_moe, fused_moe_cpu, fused_moe_ref
from splitmoe.kernels.linear import CPU_LINEAR, linear
from splitmoe.kernels.quant import (
    QuantizedWeight,
    cat_rows,
    dequantize_reused,
    held_bytes,
    permute_rows,
)
from splitmoe.models.config import ModelConfig
from splitmoe.models.gpt_oss import quantize_mxfp4
from splitmoe.models.loader import (
    CheckpointError,
    dequantize_fp8_blocks,
    load_attention_weights,
    load_expert_weights,
)

CPU = torch.device("cpu")


def fp8_weight(*shape: int, block=(16, 16), seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    *lead, N, K = shape
    bn, bk = block
    data = torch.randn(*shape, generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(*lead, -(-N // bn), -(-K // bk), generator=g) * 0.1 + 0.01
    return QuantizedWeight(data, scale, "fp8", block)


def mxfp4_weight(*shape: int, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    blocks, scales = quantize_mxfp4(torch.randn(*shape, generator=g) * 0.2)
    return QuantizedWeight(blocks.flatten(-2), scales, "mxfp4", (1, 32))


def _routing(N: int, E: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).to(torch.int32)
    ids[::5, -1] = -1  # slots served elsewhere
    return ids, torch.rand(N, k, generator=g)


# (fmt, H, I): whole blocks; partial K blocks (H 40 in 16-wide blocks); MXFP4
CASES = [("fp8", 64, 32), ("fp8", 40, 32), ("mxfp4", 64, 32)]


@pytest.mark.parametrize("fmt,H,I", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_fused_moe_is_dense_math_on_dequantized_weights(fmt, H, I, dtype, monkeypatch):
    # one GEMM for every expert call (a shape class on trial runs each candidate in turn, and
    # MKL, oneDNN and the native kernel round apart)
    monkeypatch.setattr(CPU_LINEAR, "kept", lambda shape, dtype: "mkl")
    E, N, k = 6, 37, 3
    make = fp8_weight if fmt == "fp8" else mxfp4_weight
    q13, q2 = make(E, 2 * I, H, seed=1), make(E, H, I, seed=2)
    # the dense weights dequantize-at-load gave: float32, then the run dtype
    d13, d2 = q13.dequantize(dtype), q2.dequantize(dtype)
    assert torch.equal(d13.float(), q13.dequantize().to(dtype).float())
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(3)).to(dtype)
    ids, w = _routing(N, E, k, seed=4)
    ffn = {}
    if fmt == "mxfp4":  # GPT-OSS: expert biases and the clamped SwiGLU ride along
        g = torch.Generator().manual_seed(5)
        ffn = dict(
            b13=torch.randn(E, 2 * I, generator=g).to(dtype),
            b2=torch.randn(E, H, generator=g).to(dtype),
            swiglu_limit=7.0,
            swiglu_alpha=1.702,
        )
    want = fused_moe_ref(x, d13, d2, ids, w, **ffn)
    assert torch.equal(fused_moe_ref(x, q13, q2, ids, w, **ffn), want)  # the same F.linear
    dense = fused_moe_cpu(x, d13, d2, ids, w, path="per_expert", **ffn)
    got = fused_moe(x, q13, q2, ids, w, backend="torch", **ffn)
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    # float32: the same GEMM per expert as on the dense weights
    torch.testing.assert_close(got, dense, **tol)
    err = (got.float() - want.float()).abs().max()  # oneDNN / MKL round apart in 16 bits
    assert err <= (1e-5 if dtype == torch.float32 else 2e-2) * want.float().abs().max()


def test_quantized_fused_moe_runs_per_expert_and_times_no_layouts():
    q13, q2 = fp8_weight(4, 96, 48, seed=1), fp8_weight(4, 48, 48, seed=2)
    x = torch.randn(9, 48)
    ids, w = _routing(9, 4, 2, seed=0)
    fused_moe_cpu(x, q13, q2, ids, w)
    assert cpu_moe_decision(x, q13, ids) is None  # nothing measured for this class
    with pytest.raises(ValueError, match="needs dense expert weights"):
        fused_moe_cpu(x, q13, q2, ids, w, path="wleft")
    with pytest.raises(ValueError, match="shapes do not fit"):
        fused_moe(x, q2, q2, ids, w)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_linear_on_quantized_weight(fmt, monkeypatch):
    monkeypatch.setattr(CPU_LINEAR, "kept", lambda shape, dtype: "mkl")  # F.linear's own GEMM
    q = fp8_weight(80, 64, seed=6) if fmt == "fp8" else mxfp4_weight(80, 64, seed=6)
    x = torch.randn(5, 64)
    b = torch.randn(80)
    torch.testing.assert_close(linear(x, q, b), F.linear(x, q.dequantize(), b), rtol=0, atol=0)


def test_quantized_weight_layout_and_helpers():
    q = fp8_weight(3, 40, 70, block=(16, 16))
    assert q.shape == (3, 40, 70) and q.scale.shape == (3, 3, 5)
    assert q.nbytes == 3 * 40 * 70 + 3 * 3 * 5 * 4
    for e in range(3):  # the reference is DeepSeek's weight_dequant, per expert
        want = dequantize_fp8_blocks(q.data[e], q.scale[e], (16, 16))
        assert torch.equal(q.expert(e).dequantize(), want)
        got = dequantize_reused(q.expert(e), torch.float32)
        assert torch.equal(got, want)
    assert dequantize_reused(q.expert(0), torch.float32).data_ptr() == got.data_ptr()  # reused
    m = mxfp4_weight(2, 8, 64)
    assert m.shape == (2, 8, 64) and m.data.shape == (2, 8, 32) and m.nbytes == 2 * 8 * 34
    assert m.nbytes * 32 == 17 * m.shape.numel()  # 17 bytes per 32 weights

    # rebalances: slots replaced in place, data and scales together
    held, new = fp8_weight(3, 32, 32, seed=1), fp8_weight(1, 32, 32, seed=2)
    held.index_copy_(0, torch.tensor([1]), new)
    assert torch.equal(held.expert(1).dequantize(), new.expert(0).dequantize())
    assert torch.equal(held.select(torch.tensor([1])).dequantize(), new.dequantize())
    with pytest.raises(ValueError, match="same layout"):
        held.index_copy_(0, torch.tensor([0]), mxfp4_weight(1, 32, 32))

    # fused q/k/v (or gate/up) stay quantized when the parts end on block boundaries
    a, b = fp8_weight(32, 48, seed=3), fp8_weight(8, 48, seed=4)
    fused = cat_rows([a, b], torch.float32)
    assert isinstance(fused, QuantizedWeight) and fused.shape == (40, 48)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    odd = cat_rows([b, a], torch.float32)  # 8 rows: half a block, so dense
    assert not isinstance(odd, QuantizedWeight)
    assert torch.equal(odd, torch.cat([b.dequantize(), a.dequantize()]))
    # MLA's rotary rows de-interleaved: inside a block they stay quantized
    inside = torch.cat([torch.arange(16), 16 + torch.tensor([0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5,
                                                              7, 9, 11, 13, 15])])  # fmt: skip
    p = permute_rows(a, inside, torch.float32)
    assert isinstance(p, QuantizedWeight)
    assert torch.equal(p.dequantize(), a.dequantize()[inside])
    across = torch.arange(32).flip(0)
    assert torch.equal(permute_rows(a, across, torch.float32), a.dequantize()[across])
    assert held_bytes([a, {"x": a, "y": [b.data]}]) == a.nbytes + b.data.nbytes  # once each


def test_fp8_checkpoint_loads_at_released_size(tiny_ckpt, tmp_path):
    """DeepSeek-V3 FP8 (16x16 blocks): routed experts as `QuantizedWeight` stacks of the
    released bytes, attention projections too (kv_b_proj dense), each equal to the dequantized
    checkpoint's; replicas copy their first slot."""
    fp8, dequant = quantize_fp8_checkpoint(
        tiny_ckpt("deepseek_v3"), tmp_path / "fp8", tmp_path / "dequant", block=(16, 16)
    )
    cfg, ref = ModelConfig.from_hf(fp8), ModelConfig.from_hf(dequant)
    listed = [1, 3, 1]
    got = load_expert_weights(cfg, listed, torch.float32, "cpu")
    want = load_expert_weights(ref, listed, torch.float32, "cpu")
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    for layer in cfg.moe_layers:
        w13, w2 = got[layer]
        assert isinstance(w13, QuantizedWeight) and isinstance(w2, QuantizedWeight)
        assert w13.data.dtype == torch.float8_e4m3fn and w13.shape == (3, 2 * I, H)
        n13 = 2 * I * H + (2 * I // 16) * -(-H // 16) * 4  # fp8 bytes + float32 scales
        n2 = H * I + -(-H // 16) * (I // 16) * 4
        assert w13.nbytes + w2.nbytes == 3 * (n13 + n2)
        assert torch.equal(w13.dequantize(), want[layer][0])
        assert torch.equal(w2.dequantize(), want[layer][1])
    _, layers = load_attention_weights(cfg, torch.float32, "cpu")
    _, ref_layers = load_attention_weights(ref, torch.float32, "cpu")
    for t, r in zip(layers, ref_layers):
        assert isinstance(t["kv_a_proj"], QuantizedWeight)
        assert not isinstance(t["kv_b_proj"], QuantizedWeight)
        for key, v in t.items():
            dense = v.dequantize() if isinstance(v, QuantizedWeight) else v
            assert torch.equal(dense, r[key]), key


def test_fp8_experts_need_whole_blocks_per_projection(tiny_ckpt, tmp_path):
    fp8, _ = quantize_fp8_checkpoint(
        tiny_ckpt("qwen3_moe"), tmp_path / "fp8", tmp_path / "dequant", block=(64, 16)
    )  # moe_intermediate_size 32 in 64-row blocks
    with pytest.raises(CheckpointError, match="moe_intermediate_size 32 and 64-row"):
        load_expert_weights(ModelConfig.from_hf(fp8), [0], torch.float32, "cpu")


def test_mxfp4_experts_load_as_released(tiny_ckpt, tmp_path):
    quant, plain = write_mxfp4_checkpoint(tiny_ckpt("gpt_oss"), tmp_path)
    cfg, ref = ModelConfig.from_hf(quant), ModelConfig.from_hf(plain)
    got = load_expert_weights(cfg, [2, 0, 2], torch.float32, "cpu")
    want = load_expert_weights(ref, [2, 0, 2], torch.float32, "cpu")
    for layer in cfg.moe_layers:
        w13, w2, b13, b2 = got[layer]
        assert w13.fmt == w2.fmt == "mxfp4"
        assert (w13.nbytes + w2.nbytes) * 32 == 17 * (w13.shape.numel() + w2.shape.numel())
        for a, b in zip((w13.dequantize(), w2.dequantize(), b13, b2), want[layer]):
            assert torch.equal(a, b)


def test_rebalance_swaps_quantized_slots(tiny_ckpt, tmp_path):
    fp8, _ = quantize_fp8_checkpoint(
        tiny_ckpt("qwen3_moe"), tmp_path / "fp8", tmp_path / "dequant", block=(16, 16)
    )
    cfg = ModelConfig.from_hf(fp8)
    layer = cfg.moe_layers[0]
    backend = moe_backend("torch", CPU)
    experts = LocalExperts(cfg, {layer: [0, 1, 2]}, torch.float32, CPU, backend)
    staged = experts.stage({layer: [0, 5, 2]})
    assert experts.apply(staged, layer) == 1
    want = LocalExperts(cfg, {layer: [0, 5, 2]}, torch.float32, CPU, backend)
    for a, b in zip(experts.weights[layer], want.weights[layer]):
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        assert torch.equal(a.scale, b.scale)
    assert experts.weight_bytes == want.weight_bytes == sum(w.nbytes for w in want.weights[layer])


_PEAK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from splitmoe.models.config import ModelConfig
    from splitmoe.kernels.quant import held_bytes
    from splitmoe.models.loader import load_expert_weights

    cfg = ModelConfig.from_hf(sys.argv[1])
    def status(key):
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith(key + ":"))
        return int(line.split()[1]) * 1024
    # the peak so far (imports; exec keeps the parent's in ru_maxrss) reset to the current RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    peak_before = status("VmHWM")
    w = load_expert_weights(cfg, list(range(cfg.num_experts)), torch.bfloat16, "cpu")
    print(json.dumps(dict(before=before, peak_before=peak_before, peak=status("VmHWM"),
                          after=status("VmRSS"), resident=held_bytes(w))))
    """
)


def test_fp8_load_peak_stays_at_resident_size(tiny_ckpt, tmp_path):
    """All experts of a 2-layer, 64-expert FP8 checkpoint (~50 MB) read on one rank: the
    process's peak RSS grows by the resident bytes within 10% (no transient copy of every
    expert, no memory-mapped shard pages). The peak is the kernel's VmHWM, reset before the
    load (``ru_maxrss`` cannot be: it keeps the imports' and the parent's high-water mark)."""
    ckpt = write_fp8_experts(
        tiny_ckpt("qwen3_moe"), tmp_path / "big", hidden=512, inter=256, experts=64, layers=2
    )
    run = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(ckpt)], capture_output=True, text=True, check=True
    )
    m = json.loads(run.stdout.strip().splitlines()[-1])
    resident = m["resident"]
    assert resident == 2 * 64 * 3 * (512 * 256 + 4 * 2 * 4)  # fp8 bytes + 2x4 scales of 4 bytes
    growth = m["peak"] - max(m["before"], m["peak_before"])
    assert m["after"] - m["before"] > 0.9 * resident, m  # the weights are really resident
    assert growth <= 1.10 * resident, m
