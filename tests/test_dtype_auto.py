"""``dtype="auto"``: bfloat16 on a CPU that multiplies it natively, float32 on other CPUs, the
checkpoint's dtype on CUDA; the capability probe is passed in, not patched."""

from __future__ import annotations

import pytest
import torch

from splitmoe.config import EngineConfig, cpu_native_bf16, resolve_dtype
from splitmoe.models.config import ModelConfig

# torch._C._cpu._get_cpu_capability()'s keys on three kinds of x86 CPU
SAPPHIRE_RAPIDS = {"avx512_bf16": True, "amx_bf16": True, "amx_tile": True, "avx512_f": True}
ZEN4 = {"avx512_bf16": True, "amx_bf16": False, "amx_tile": False, "avx512_f": True}
SKYLAKE_X = {"avx512_bf16": False, "amx_bf16": False, "amx_tile": False, "avx512_f": True}
ZEN3 = {"avx512_bf16": False, "amx_bf16": False, "avx2": True}


@pytest.mark.parametrize("checkpoint", ["float32", "bfloat16", "float16", "unknown"])
def test_auto_on_cpu_follows_the_cpu_not_the_checkpoint(checkpoint):
    assert resolve_dtype("auto", checkpoint, "cpu", cpu_bf16=True) == torch.bfloat16
    assert resolve_dtype("auto", checkpoint, "cpu", cpu_bf16=False) == torch.float32


def test_auto_on_cuda_is_the_checkpoint_dtype():
    for cpu_bf16 in (True, False):
        assert resolve_dtype("auto", "float16", "cuda", cpu_bf16=cpu_bf16) == torch.float16
        assert resolve_dtype("auto", "float32", "cuda", cpu_bf16=cpu_bf16) == torch.float32
        assert resolve_dtype("auto", "int8", "cuda", cpu_bf16=cpu_bf16) == torch.bfloat16


@pytest.mark.parametrize("name,want", [("float32", torch.float32), ("bf16", torch.bfloat16),
                                       ("half", torch.float16)])  # fmt: skip
def test_an_explicit_dtype_wins_over_the_cpu(name, want):
    for cpu_bf16 in (True, False):
        assert resolve_dtype(name, "bfloat16", "cpu", cpu_bf16=cpu_bf16) == want


def test_unknown_dtype_is_an_error():
    with pytest.raises(ValueError, match="'auto', 'float32', 'bfloat16', 'float16'"):
        resolve_dtype("int8", "float32", "cpu", cpu_bf16=True)


def test_native_bf16_is_amx_or_avx512_bf16():
    onednn_bf16 = torch.backends.mkldnn.is_available() and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    assert cpu_native_bf16(SAPPHIRE_RAPIDS) == onednn_bf16
    assert cpu_native_bf16(ZEN4) == onednn_bf16
    assert cpu_native_bf16({"amx_bf16": True}) == onednn_bf16
    assert not cpu_native_bf16(SKYLAKE_X)
    assert not cpu_native_bf16(ZEN3)
    assert not cpu_native_bf16({})  # a torch or CPU whose probe says nothing: float32


def test_this_machine_resolves_as_its_probe_says(tiny_ckpt):
    native = cpu_native_bf16()
    assert native == cpu_native_bf16(torch._C._cpu._get_cpu_capability())
    model = ModelConfig.from_hf(tiny_ckpt("qwen3_moe"))  # a float32 checkpoint
    assert model.checkpoint_dtype == "float32"
    cfg = EngineConfig(model, device="cpu")
    assert cfg.torch_dtype == (torch.bfloat16 if native else torch.float32)
    assert EngineConfig(model, device="cpu", dtype="float32").torch_dtype == torch.float32
