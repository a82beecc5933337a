"""Tiny random-weight MoE checkpoints and HF reference generation for the tests.

Nothing here is downloaded: checkpoints are built with transformers' own model
classes, with a fixed seed, and saved with ``save_pretrained`` (safetensors).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from splitmoe import LLM

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "minimax_m2")
MLA_FAMILIES = ("deepseek_v3", "deepseek_v2")
# Multi-head latent attention shapes of the tiny DeepSeek checkpoints
KV_LORA_RANK, Q_LORA_RANK, ROPE_DIM, NOPE_DIM, V_DIM = 32, 24, 8, 16, 16

VOCAB = 128
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
EXPERT_INTERMEDIATE = 32
DENSE_INTERMEDIATE = 96
SHARED_INTERMEDIATE = 48
WIDE_HEAD_DIM = 32  # GLM-4.5 / MiniMax-M2: num_heads * head_dim > hidden, as in the releases
MAX_POS = 256
INIT_STD = 0.1
# Per-parameter init std overrides (by substring of the parameter name). A large
# embedding makes the next token depend on more than the current one (less
# repetitive greedy output); a larger lm_head widens top-1/top-2 logit gaps.
INIT_STD_OVERRIDES = {"embed_tokens": 1.0, "lm_head": 0.3, "sinks": 1.0}
# GPT-OSS: a window shorter than the test prompts, a clamp the tiny activations reach, YaRN
# whose ramp falls inside the head dim.
GPT_OSS_WINDOW = 8
GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
    "rope_theta": 150000.0,
}

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]


def _family_shape(family: str, num_experts: int) -> tuple[str, dict]:
    """(transformers config class, its kwargs beyond the common ones) of a non-MLA family."""
    if family == "qwen3_moe":
        return "Qwen3MoeConfig", dict(
            intermediate_size=DENSE_INTERMEDIATE,
            moe_intermediate_size=EXPERT_INTERMEDIATE,
            num_experts=num_experts,
            norm_topk_prob=True,
            mlp_only_layers=[],
            decoder_sparse_step=1,
        )
    if family == "qwen2_moe":
        return "Qwen2MoeConfig", dict(
            intermediate_size=DENSE_INTERMEDIATE,
            moe_intermediate_size=EXPERT_INTERMEDIATE,
            shared_expert_intermediate_size=SHARED_INTERMEDIATE,
            num_experts=num_experts,
            norm_topk_prob=False,
            qkv_bias=True,
            mlp_only_layers=[],
            decoder_sparse_step=1,
        )
    if family == "mixtral":
        # Mixtral's intermediate_size *is* the expert intermediate size.
        return "MixtralConfig", dict(
            intermediate_size=EXPERT_INTERMEDIATE, num_local_experts=num_experts
        )
    if family == "olmoe":
        # OLMoE's intermediate_size *is* the expert intermediate size; its default
        # eos (50279) lies outside the tiny vocab, the common kwargs fix it.
        return "OlmoeConfig", dict(
            intermediate_size=EXPERT_INTERMEDIATE, num_experts=num_experts, norm_topk_prob=False
        )
    if family == "glm4_moe":
        # GLM-4.5's shape of things: heads wider than hidden / heads, half of each head
        # rotates, qkv bias, per-head q/k norm, grouped sigmoid routing (2 groups of 4, one
        # chosen) scaled by 2.5, a shared expert, layer 0 dense.
        return "Glm4MoeConfig", dict(
            head_dim=WIDE_HEAD_DIM,
            intermediate_size=DENSE_INTERMEDIATE,
            moe_intermediate_size=EXPERT_INTERMEDIATE,
            n_routed_experts=num_experts,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            attention_bias=True,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
        )
    if family == "minimax_m2":
        # MiniMax-M2's intermediate_size *is* the expert size; heads wider than hidden / heads,
        # rotary_dim a quarter of a head.
        return "MiniMaxM2Config", dict(
            intermediate_size=EXPERT_INTERMEDIATE,
            num_local_experts=num_experts,
            head_dim=WIDE_HEAD_DIM,
            rotary_dim=WIDE_HEAD_DIM // 4,
        )
    if family == "gpt_oss":
        return "GptOssConfig", dict(
            intermediate_size=EXPERT_INTERMEDIATE,
            num_local_experts=num_experts,
            head_dim=16,
            sliding_window=GPT_OSS_WINDOW,
            swiglu_limit=1.0,
            rope_parameters=dict(GPT_OSS_ROPE),
        )
    raise ValueError(f"unknown family {family!r}")


def _config(family: str, num_layers: int, num_experts: int, top_k: int, overrides: dict):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=num_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
        initializer_range=INIT_STD,
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        num_experts_per_tok=top_k,
    )
    if family in MLA_FAMILIES:
        return _deepseek_config(family, common, num_experts, overrides)
    config_class, shape = _family_shape(family, num_experts)
    return getattr(transformers, config_class)(**{**common, **shape, **overrides})


def _deepseek_config(family: str, common: dict, num_experts: int, overrides: dict):
    """DeepSeek-V3 (q LoRA, YaRN with an mscale correction, grouped sigmoid routing, attention
    biases) or DeepSeek-V2 (no q LoRA, group-limited softmax routing): 2 shared experts, the
    first layer dense. ``overrides`` change any of it."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    common = dict(common, num_key_value_heads=HEADS)
    kw = dict(
        common,
        intermediate_size=DENSE_INTERMEDIATE,
        moe_intermediate_size=EXPERT_INTERMEDIATE,
        n_routed_experts=num_experts,
        n_shared_experts=2,
        first_k_dense_replace=1,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_DIM,
        qk_nope_head_dim=NOPE_DIM,
        v_head_dim=V_DIM,
        n_group=4,
        topk_group=2,
    )
    if family == "deepseek_v3":
        kw.update(
            q_lora_rank=Q_LORA_RANK,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            attention_bias=True,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=MAX_POS // 4,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=0.8,
            ),
        )
        kw.update(overrides)
        return DeepseekV3Config(**kw)
    kw.update(q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=2.0)
    kw.update(overrides)
    return DeepseekV2Config(**kw)


def _model_class(family: str):
    from transformers import (
        DeepseekV2ForCausalLM,
        DeepseekV3ForCausalLM,
        Glm4MoeForCausalLM,
        GptOssForCausalLM,
        MiniMaxM2ForCausalLM,
        MixtralForCausalLM,
        OlmoeForCausalLM,
        Qwen2MoeForCausalLM,
        Qwen3MoeForCausalLM,
    )

    return {
        "qwen3_moe": Qwen3MoeForCausalLM,
        "qwen2_moe": Qwen2MoeForCausalLM,
        "mixtral": MixtralForCausalLM,
        "olmoe": OlmoeForCausalLM,
        "glm4_moe": Glm4MoeForCausalLM,
        "minimax_m2": MiniMaxM2ForCausalLM,
        "deepseek_v3": DeepseekV3ForCausalLM,
        "deepseek_v2": DeepseekV2ForCausalLM,
        "gpt_oss": GptOssForCausalLM,
    }[family]


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Larger-than-default init so routing and logits are not near-ties.

    Norm weights are 1 + noise (so a runtime that ignores them is caught), every
    other parameter (biases included) is N(0, std^2), std = INIT_STD unless
    INIT_STD_OVERRIDES names it. Routers' correction biases (buffers, which HF
    zeroes) are N(0, INIT_STD^2) too.
    """
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, b in sorted(model.named_buffers()):
            if "e_score_correction_bias" in name:
                b.copy_(INIT_STD * torch.randn(b.shape, generator=g, dtype=torch.float32))
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name.lower():
                p.copy_(1.0 + 0.1 * noise)
            else:
                std = INIT_STD
                for key, val in INIT_STD_OVERRIDES.items():
                    if key in name:
                        std = val
                p.copy_(std * noise)


# The tiny tokenizer has no newline: a chat template on one line
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def write_tiny_tokenizer(out_dir: Path) -> None:
    """A character-level tokenizer over the tiny vocab: ids 0-2 are special,
    the rest are printable ASCII characters (and padding characters up to VOCAB)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]  # 95 printable characters
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab[ch] = len(vocab)
    extra = 0
    while len(vocab) < VOCAB:
        vocab[f"\u00c0{extra}"] = len(vocab)  # filler symbols (never produced by encode)
        extra += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def make_tiny_checkpoint(
    family: str,
    out_dir: Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    with_tokenizer: bool = True,
    **overrides,
) -> Path:
    """Build a tiny random-weight checkpoint of ``family`` in ``out_dir``.

    ``overrides`` go to the transformers config (e.g. ``mlp_only_layers=[0]``,
    ``eos_token_id=17``). Same family + seed + shapes gives identical weights,
    whatever the overrides that do not change shapes.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _config(family, num_layers, num_experts, top_k, overrides)
    torch.manual_seed(seed)
    model = _model_class(family)(config).to(torch.float32)
    _reinit(model, seed)
    model.eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    # transformers 5 writes Qwen3-MoE's expert count as "num_local_experts";
    # checkpoints on the hub say "num_experts". Write both, as either may be met.
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if family == "qwen3_moe" and "num_experts" not in cfg:
        cfg["num_experts"] = num_experts
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    # Keep generation_config.json consistent with config.json's special ids.
    gc_path = out_dir / "generation_config.json"
    if gc_path.exists():
        gc = json.loads(gc_path.read_text())
        for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
            gc[k] = getattr(config, k, None)
        gc_path.write_text(json.dumps(gc, indent=2))
    if with_tokenizer:
        write_tiny_tokenizer(out_dir)
    return out_dir


def _quantizable(name: str, t: torch.Tensor) -> bool:
    """The tensors DeepSeek-V3's (and MiniMax-M2's) release stores in fp8: every projection
    weight (attention, dense MLP, shared and routed experts, MiniMax's w1/w2/w3 included), not
    the router, embeddings, LM head or norms."""
    ends = ("_proj.weight", "_proj_with_mqa.weight", ".w1.weight", ".w2.weight", ".w3.weight")
    proj = name.endswith(ends)
    return t.dim() == 2 and proj and ".mlp.gate." not in name


def quantize_fp8_checkpoint(src, fp8_dir, dequant_dir, block=(128, 128)) -> tuple[Path, Path]:
    """``src`` block-quantized in DeepSeek-V3's released layout (float8_e4m3fn weights, a float32
    ``weight_scale_inv`` per ``block``, ``quantization_config`` in config.json) into
    ``fp8_dir``, and the same weights dequantized (float32, what HF computes with) into
    ``dequant_dir``."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, fp8_dir, dequant_dir = Path(src), Path(fp8_dir), Path(dequant_dir)
    tensors = load_file(str(src / "model.safetensors"))
    fp8, deq = {}, {}
    bn, bk = block
    for name, t in tensors.items():
        if not _quantizable(name, t):
            fp8[name] = deq[name] = t
            continue
        N, K = t.shape
        padded = torch.zeros(-(-N // bn) * bn, -(-K // bk) * bk)
        padded[:N, :K] = t
        blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # e4m3's max
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        fp8[name] = q.view(padded.shape)[:N, :K].contiguous()
        fp8[name.replace(".weight", ".weight_scale_inv")] = scale
        deq[name] = (q.float() * scale[:, None, :, None]).view(padded.shape)[:N, :K].contiguous()
    for out, weights in ((fp8_dir, fp8), (dequant_dir, deq)):
        shutil.copytree(src, out, dirs_exist_ok=True)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg_path = fp8_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return fp8_dir, dequant_dir


_HF_MODELS: dict[str, torch.nn.Module] = {}


def _load_hf(ckpt_dir) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    key = str(Path(ckpt_dir).resolve())
    if key not in _HF_MODELS:
        model = AutoModelForCausalLM.from_pretrained(
            key, dtype=torch.float32, attn_implementation="eager"
        )
        model.eval()
        require_hf_swiglu_config(model.config, model.modules())
        _HF_MODELS[key] = model
    return _HF_MODELS[key]


def require_hf_swiglu_config(config, modules) -> None:
    """Skips the calling test where transformers' GPT-OSS experts (among ``modules``) ignore the
    config's ``swiglu_limit`` / ``swiglu_alpha``: up to 5.17 they hard-code 7.0 and 1.702, so HF
    computes another function than the tiny checkpoints' config (limit 1.0, where the clamp
    bites) says and is no oracle for it (seen on a GPU machine's transformers 5.17: every
    backend and topology "differed" alike, and agreed with HF 5.24)."""
    limit = getattr(config, "swiglu_limit", None)
    if limit is None:
        return
    import pytest
    import transformers

    for m in modules:
        if hasattr(m, "limit") and hasattr(m, "alpha"):
            if (m.limit, m.alpha) != (limit, getattr(config, "swiglu_alpha", m.alpha)):
                pytest.skip(
                    f"transformers {transformers.__version__}'s GPT-OSS ignores the config's "
                    f"swiglu_limit={limit} (uses {m.limit}): no oracle for the tiny checkpoint"
                )
            return


def hf_greedy(ckpt_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of one prompt (no padding) by HF transformers, float32, eager
    attention: exactly ``max_new_tokens`` new token ids, EOS included like any other token.

    A plain argmax loop over the model's forward with its KV cache, rather than `generate`, so no
    generation-config logits processor (e.g. min_new_tokens masking EOS) alters the oracle."""
    model = _load_hf(ckpt_dir)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    out: list[int] = []
    past = None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            res = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]], dtype=torch.long)
    return out


def prompt_ids(length: int, seed: int) -> list[int]:
    """A deterministic prompt of ``length`` non-special token ids."""
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(len(SPECIAL_TOKENS), VOCAB, (length,), generator=g).tolist()


def cpu_llm(ckpt_dir, attention_ranks: int, expert_ranks: int, **options):
    """An `LLM` on a tiny checkpoint, float32 on CPU (HF's exact tokens are the oracle)."""
    return LLM(
        str(ckpt_dir),
        attention_ranks=attention_ranks,
        expert_ranks=expert_ranks,
        dtype="float32",
        device="cpu",
        **options,
    )
