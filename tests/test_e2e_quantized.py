"""Released quantized checkpoints served at their released size: FP8 block-quantized Qwen3-MoE,
MiniMax-M2 and DeepSeek-V3, and MXFP4 GPT-OSS, give HF's greedy tokens (float32, HF run on the
dequantized weights) with the experts (and FP8 attention projections) resident as
`QuantizedWeight`, on 1+0, 1+1 and 2+2 ranks; each rank reports its resident ``weight_bytes``,
the expert ranks' equal to the checkpoint bytes of the experts they hold.

1+1 runs of DeepSeek-V3, MiniMax-M2 (FP8) and GPT-OSS (MXFP4) are in test_e2e_mla,
test_e2e_glm_minimax and test_e2e_gpt_oss; here Qwen3-MoE on 1+1, every family on 1+0, and one
2+2 run per format (four rank processes each).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from quant_models import write_mxfp4_checkpoint
from safetensors import safe_open
from tiny_models import cpu_llm, prompt_ids, quantize_fp8_checkpoint

from splitmoe import SamplingParams

MAX_TOKENS = 8
PROMPTS = [prompt_ids(n, seed=900 + i) for i, n in enumerate((3, 14, 9))]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def _expert_bytes(ckpt: Path) -> dict[tuple[int, int], int]:
    """Checkpoint bytes of each (layer, expert): its tensors' data and scales (FP8: weight and
    weight_scale_inv per projection; MXFP4: blocks, scales and biases of the fused tensors,
    split evenly over the experts)."""
    out: dict[tuple[int, int], int] = {}
    for shard in ckpt.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                parts = name.split(".")
                if "experts" not in parts:
                    continue
                layer = int(parts[parts.index("layers") + 1])
                t = f.get_tensor(name)
                nbytes = t.numel() * t.element_size()
                after = parts[parts.index("experts") + 1]
                if after.isdigit():  # one tensor per expert
                    key = (layer, int(after))
                    out[key] = out.get(key, 0) + nbytes
                else:  # fused [E, ...]
                    for e in range(t.shape[0]):
                        out[(layer, e)] = out.get((layer, e), 0) + nbytes // t.shape[0]
    return out


def _run(ckpt, dequant, attention_ranks, expert_ranks, hf_ref) -> list[dict]:
    with cpu_llm(ckpt, attention_ranks, expert_ranks) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        stats = llm.stats()
    for i, (p, o) in enumerate(zip(PROMPTS, outs)):
        assert list(o.token_ids) == hf_ref(dequant, p, MAX_TOKENS), f"prompt {i} (len {len(p)})"
    return stats


def _check_weight_bytes(stats: list[dict], ckpt: Path, dequant: Path) -> None:
    per_expert = _expert_bytes(ckpt)
    dense_total = sum(
        f.stat().st_size for f in Path(dequant).glob("*.safetensors")
    )  # float32 weights, what dequantize-at-load held
    assert all(s["weight_bytes"] > 0 for s in stats)
    for s in stats:
        if s["role"] == "expert":
            want = sum(per_expert[(int(la), e)] for la, ids in s["slots"].items() for e in ids)
            assert abs(s["weight_bytes"] - want) <= 0.15 * want, (s["rank"], s["weight_bytes"])
        else:  # every weight the rank holds, quantized ones at their released size
            assert s["weight_bytes"] < dense_total


@pytest.fixture(scope="module")
def fp8(tiny_ckpt, tmp_path_factory):
    """Family -> (FP8 checkpoint in 16x16 blocks, the same weights dequantized)."""
    cache = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in cache:
            out = tmp_path_factory.mktemp(f"{family}-fp8")
            cache[family] = quantize_fp8_checkpoint(
                tiny_ckpt(family), out / "fp8", out / "dequant", block=(16, 16)
            )
        return cache[family]

    return get


@pytest.mark.parametrize(
    "family,attention_ranks,expert_ranks",
    [
        ("qwen3_moe", 1, 0),
        ("qwen3_moe", 1, 1),
        ("minimax_m2", 1, 0),
        ("deepseek_v3", 1, 0),
        ("deepseek_v3", 2, 2),
    ],
)
def test_fp8_resident(family, attention_ranks, expert_ranks, fp8, hf_ref):
    ckpt, dequant = fp8(family)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [16, 16]
    stats = _run(ckpt, dequant, attention_ranks, expert_ranks, hf_ref)
    _check_weight_bytes(stats, ckpt, dequant)


@pytest.mark.parametrize("attention_ranks,expert_ranks", [(1, 0), (2, 2)])
def test_mxfp4_resident(attention_ranks, expert_ranks, tiny_ckpt, tmp_path, hf_ref):
    quant, plain = write_mxfp4_checkpoint(tiny_ckpt("gpt_oss"), tmp_path)
    stats = _run(quant, plain, attention_ranks, expert_ranks, hf_ref)
    _check_weight_bytes(stats, quant, plain)
