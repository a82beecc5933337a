"""The one memory model (`splitmoe.memory`): byte counts against real checkpoints and the
resident layout, the planner CLI's DeepSeek-V3 answers, the simulator's use of it, and the
start-up check of `LLM`."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from splitmoe.kernels.quant import QuantizedWeight
from splitmoe.memory import (
    GIB,
    LayoutDoesNotFit,
    ModelDims,
    check_fits,
    engine_memory,
    growth_fits,
    linear_bytes,
    rank_memory,
)
from splitmoe.models.config import ModelConfig
from splitmoe.options import engine_config
from splitmoe.plan_memory import main as plan_memory
from splitmoe.sim.hardware import load_profile
from splitmoe.sim.model import CONFIG_DIR, ModelShape
from splitmoe.sim.simulator import Deployment, Simulator
from tests import tiny_models


def _file_bytes(ckpt) -> tuple[int, int]:
    """(bytes of every tensor but the routed experts, bytes of the routed experts) as stored."""
    attn = experts = 0
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            n = t.numel() * t.element_size()
            if ".experts." in name or ".block_sparse_moe.experts." in name:
                experts += n
            else:
                attn += n
    return attn, experts


@pytest.mark.parametrize(
    "rows, cols, fmt, block",
    [(4096, 7168, "fp8", (128, 128)), (7168, 2048, "fp8", (128, 128)), (576, 7168, "fp8",
     (128, 128)), (100, 70, "fp8", (16, 32)), (5760, 2880, "mxfp4", (1, 32))],
)  # fmt: skip
def test_linear_bytes_equal_the_resident_layout(rows, cols, fmt, block):
    """What `QuantizedWeight.nbytes` holds for a weight of that shape (meta tensors: no data)."""
    if fmt == "fp8":
        data = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device="meta")
        scale = torch.empty(-(-rows // block[0]), -(-cols // block[1]), device="meta")
    else:
        data = torch.empty(rows, cols // 2, dtype=torch.uint8, device="meta")
        scale = torch.empty(rows, cols // 32, dtype=torch.uint8, device="meta")
    w = QuantizedWeight(data, scale, fmt, block)
    assert linear_bytes(rows, cols, fmt, 2, block) == w.nbytes
    assert linear_bytes(rows, cols, None, 2) == rows * cols * 2


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "gpt_oss", "qwen2_moe"])
def test_weights_equal_the_checkpoint(tmp_path, family):
    """Float32 checkpoints: the attention rank's weights and all expert ranks' weights are the
    bytes of the checkpoint's tensors (norms, biases, routers and sinks included)."""
    ckpt = tiny_models.make_tiny_checkpoint(family, tmp_path / family, with_tokenizer=False)
    dims = ModelDims.from_config(ModelConfig.from_hf(ckpt))
    table = rank_memory(dims, 1, 2, dtype_bytes=4)
    attn, experts = _file_bytes(ckpt)
    assert table.ranks[0].weight_bytes == attn
    assert sum(r.weight_bytes for r in table.role("expert")) == experts


def _quantize_kv_a(path, block):
    """DeepSeek-V3's release keeps ``kv_a_proj_with_mqa`` in fp8 too (its inference code builds
    every projection but the router and LM head as an fp8 ``Linear``); the tiny helper leaves it
    in float32, so quantize it here the same way."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    bn, bk = block
    for name in [n for n in tensors if n.endswith("kv_a_proj_with_mqa.weight")]:
        t = tensors[name]
        N, K = t.shape
        padded = torch.zeros(-(-N // bn) * bn, -(-K // bk) * bk)
        padded[:N, :K] = t
        blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        tensors[name] = q.view(padded.shape)[:N, :K].contiguous()
        tensors[name.replace(".weight", ".weight_scale_inv")] = scale
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_fp8_weights_equal_the_released_checkpoint(tmp_path):
    """A tiny DeepSeek-V3 in the released FP8 layout: 1 byte a weight plus a float32 scale per
    block (partial blocks included), everything else in the run dtype."""
    src = tiny_models.make_tiny_checkpoint("deepseek_v3", tmp_path / "src", with_tokenizer=False)
    fp8, _ = tiny_models.quantize_fp8_checkpoint(
        src, tmp_path / "fp8", tmp_path / "deq", block=(16, 32)
    )
    _quantize_kv_a(fp8 / "model.safetensors", (16, 32))
    dims = ModelDims.from_config(ModelConfig.from_hf(fp8))
    assert dims.quantization == "fp8" and dims.block == (16, 32)
    table = rank_memory(dims, 1, 3, dtype_bytes=4)
    attn, experts = _file_bytes(fp8)
    assert sum(r.weight_bytes for r in table.role("expert")) == experts
    # the attention rank keeps kv_b_proj dense (MLA splits it per head): its fp8 data and scales
    # in the file are float32 on the rank
    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:
        kv_b = [n for n in f.keys() if "kv_b_proj" in n]
        stored = sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in kv_b)
        dense = sum(4 * f.get_tensor(n).numel() for n in kv_b if n.endswith(".weight"))
        fp8_kept = sum(
            f.get_tensor(n).numel() * f.get_tensor(n).element_size()
            for n in f.keys()
            if (n.endswith("weight_scale_inv") or n[: -len("weight")] + "weight_scale_inv"
                in f.keys()) and "kv_b_proj" not in n and ".experts." not in n
        )  # fmt: skip
    assert len(kv_b) == 2 * dims.num_layers
    assert table.ranks[0].weight_bytes == attn - stored + dense
    assert table.ranks[0].weights["fp8"] == fp8_kept
    assert set(table.ranks[1].weights) == {"fp8"}
    # the dequantized copy holds every weight in float32: ~4x the expert bytes
    deq = rank_memory(dims.dequantized(), 1, 3, dtype_bytes=4)
    assert sum(r.weight_bytes for r in deq.role("expert")) > 3.5 * experts


def test_weights_equal_what_the_ranks_hold(tmp_path):
    """The contract with the runtime: each rank's ``weight_bytes`` in `LLM.stats` is the model's
    figure, for FP8 attention and experts (DeepSeek-V3) and MXFP4 experts (GPT-OSS)."""
    from quant_models import write_mxfp4_checkpoint

    from splitmoe import LLM, SamplingParams

    src = tiny_models.make_tiny_checkpoint("deepseek_v3", tmp_path / "ds", with_tokenizer=False)
    fp8, _ = tiny_models.quantize_fp8_checkpoint(
        src, tmp_path / "fp8", tmp_path / "deq", block=(16, 16)
    )
    _quantize_kv_a(fp8 / "model.safetensors", (16, 16))
    oss = tiny_models.make_tiny_checkpoint("gpt_oss", tmp_path / "oss", with_tokenizer=False)
    mxfp4, _ = write_mxfp4_checkpoint(oss, tmp_path / "oss-q")
    opts = dict(attention_ranks=1, expert_ranks=1, device="cpu", dtype="float32")
    for ckpt in (fp8, mxfp4):
        table = engine_memory(engine_config(str(ckpt), **opts))
        with LLM(str(ckpt), **opts) as llm:
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1))
            held = {s["rank"]: s["weight_bytes"] for s in llm.stats()}
        assert held == {r.rank: r.weight_bytes for r in table.ranks}, ckpt.name


def test_expert_placement_and_kv():
    dims = ModelShape.from_config("deepseek-v3").memory_dims()
    t = rank_memory(dims, 2, 6, kv_tokens=1000, redundant_experts=4)
    assert [r.experts for r in t.role("expert")] == [44, 44, 43, 43, 43, 43]  # 260 slots
    per_expert = dims.num_moe_layers * (3 * 7168 * 2048 + 4 * (2 * 16 * 56 + 56 * 16))
    assert t.ranks[2].weights == {"fp8": 44 * per_expert}
    assert t.ranks[0].kv_cache == 1000 * 61 * 576 * 2  # the MLA latent + rotary key
    assert all(r.buffers == 0 for r in t.ranks)  # no step tokens: no buffers
    colocated = rank_memory(dims, 4, 0)
    assert colocated.ranks[0].experts == 256 and len(colocated.ranks) == 4


def test_plan_memory_deepseek_v3(capsys):
    """The issue's lines: FP8 fits 8x H200 and 16x H100 with the proposed A/E; bf16 does not
    fit 8x H200."""
    assert plan_memory(["--model", "deepseek-v3", "--gpus", "8", "--gpu-memory-gb", "141"]) == 0
    out = capsys.readouterr().out
    assert "fits: 2 attention + 6 expert ranks" in out and "w fp8 GB" in out
    assert plan_memory(["--model", "deepseek-v3", "--gpus", "16", "--gpu-memory-gb", "80"]) == 0
    assert "fits: 6 attention + 10 expert ranks" in capsys.readouterr().out
    rc = plan_memory(
        ["--model", "deepseek-v3", "--gpus", "8", "--gpu-memory-gb", "141", "--dequantized"]
    )
    cap = capsys.readouterr()
    assert rc == 1 and "does not fit" in cap.err and "NO" in cap.out
    # an explicit layout that does not fit, from a checkpoint directory's config.json
    rc = plan_memory(
        ["--model", "deepseek-v3", "--attention-ranks", "4", "--expert-ranks", "4",
         "--gpu-memory-gb", "141"]
    )  # fmt: skip
    assert rc == 1 and "rank 4 (expert)" in capsys.readouterr().err


def test_plan_memory_reads_a_checkpoint_directory(tmp_path, capsys):
    ckpt = tiny_models.make_tiny_checkpoint("qwen3_moe", tmp_path / "q", with_tokenizer=False)
    argv = ["--model", str(ckpt), "--attention-ranks", "1", "--expert-ranks", "1"]
    assert plan_memory([*argv, "--gpu-memory-gb", "1"]) == 0
    assert plan_memory([*argv, "--gpu-memory-gb", "0.0001"]) == 1
    capsys.readouterr()


def test_simulator_memory_is_the_memory_model():
    shape = ModelShape.from_config("deepseek-v3")
    sim = Simulator(shape, load_profile("h200"))
    attn_gb, exp_gb = sim.memory_gb(Deployment(2, 6), 16, 4096)
    t = rank_memory(shape.memory_dims(), 2, 6, kv_tokens=16 * 4096)
    assert attn_gb * 1e9 == pytest.approx(t.ranks[0].total)
    assert exp_gb * 1e9 == pytest.approx(t.ranks[2].total)


def test_llm_refuses_a_layout_that_does_not_fit(tmp_path):
    """Before any rank starts: the table, and which rank does not fit."""
    from splitmoe import LLM

    ckpt = tiny_models.make_tiny_checkpoint("qwen3_moe", tmp_path / "q", with_tokenizer=False)
    cfg = engine_config(str(ckpt), device="cpu", dtype="float32", num_kv_blocks=10**9)
    assert engine_memory(cfg).ranks[0].kv_cache > 10**12
    with pytest.raises(LayoutDoesNotFit, match="memory per rank") as err:
        LLM(str(ckpt), device="cpu", dtype="float32", num_kv_blocks=10**9)
    assert "rank processes on this host need" in str(err.value)
    # the defaults fit
    ok = check_fits(engine_config(str(ckpt), device="cpu", dtype="float32"))
    assert not isinstance(ok, str) and ok.ranks[0].kv_cache > 0


def test_kimi_k2_config_is_sized(tmp_path):
    """Kimi-K2 as released (model_type kimi_k2, FP8): 384 experts of 2048, 60 MoE layers."""
    raw = json.loads((CONFIG_DIR / "kimi-k2.json").read_text())
    assert raw["model_type"] == "kimi_k2"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    dims = ModelDims.from_config(ModelConfig.from_hf(tmp_path))
    expert = dims.expert_bytes(2)["fp8"] * dims.num_experts * dims.num_moe_layers
    assert expert / 1e9 == pytest.approx(1015, rel=0.01)  # ~1 TB in FP8 (2,029 GB in bf16)


def _cpu_config(ckpt, **options):
    return engine_config(str(ckpt), dtype="float32", device="cpu", **options)


def _with(cfg, **parallel):
    return replace(cfg, parallel=replace(cfg.parallel, **parallel))


def test_expert_memory_budget_is_checked_at_start_up(tiny_ckpt):
    cfg = _cpu_config(tiny_ckpt("qwen3_moe"), expert_ranks=2)
    need = engine_memory(cfg).role("expert")[0].total
    check_fits(_with(cfg, expert_memory_gb=need / GIB))
    with pytest.raises(LayoutDoesNotFit, match="over expert_memory_gb"):
        check_fits(_with(cfg, expert_memory_gb=need / 2 / GIB))


def test_growth_fits_the_budget_and_each_devices_room(tiny_ckpt):
    """1 + 3 expert ranks of the tiny model (8 experts: 3 + 3 + 2 slots a layer) losing the
    first: the two survivors grow to 4 + 4, within ``expert_memory_gb`` and what their device
    has free (two ranks on one device: what both add), or not."""
    before = _cpu_config(tiny_ckpt("qwen3_moe"), expert_ranks=3)
    after = _with(before, expert_ranks=2)
    old, new = engine_memory(before).role("expert"), engine_memory(after).role("expert")
    added = [new[0].total - old[1].total, new[1].total - old[2].total]
    assert all(a > 0 for a in added)
    both = sum(added)
    assert growth_fits(before, after, [1, 2], [("h/cpu", both), ("h/cpu", both)]) is None
    assert growth_fits(before, after, [1, 2], [("h/cpu", None), ("h/cpu", None)]) is None
    short = growth_fits(before, after, [1, 2], [("h/cpu", both - 1), ("h/cpu", both)])
    assert short is not None and "more on h/cpu" in short
    apart = [("a/cpu", max(added)), ("b/cpu", max(added))]  # (each on a device of its own)
    assert growth_fits(before, after, [1, 2], apart) is None
    capped = _with(after, expert_memory_gb=new[0].total / 2 / GIB)
    over = growth_fits(before, capped, [1, 2], [("h/cpu", None), ("h/cpu", None)])
    assert over is not None and "over expert_memory_gb" in over
