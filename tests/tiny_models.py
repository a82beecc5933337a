"""Tiny random-weight MoE checkpoints and HF reference generation for the tests.

Nothing here is downloaded: checkpoints are built with transformers' own model
classes, with a fixed seed, and saved with ``save_pretrained`` (safetensors).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from splitmoe import LLM

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")

VOCAB = 128
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
EXPERT_INTERMEDIATE = 32
DENSE_INTERMEDIATE = 96
SHARED_INTERMEDIATE = 48
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


def _config(family: str, num_layers: int, num_experts: int, top_k: int, overrides: dict):
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

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
    if family == "qwen3_moe":
        kw = dict(
            common,
            intermediate_size=DENSE_INTERMEDIATE,
            moe_intermediate_size=EXPERT_INTERMEDIATE,
            num_experts=num_experts,
            norm_topk_prob=True,
            mlp_only_layers=[],
            decoder_sparse_step=1,
        )
        kw.update(overrides)
        return Qwen3MoeConfig(**kw)
    if family == "qwen2_moe":
        kw = dict(
            common,
            intermediate_size=DENSE_INTERMEDIATE,
            moe_intermediate_size=EXPERT_INTERMEDIATE,
            shared_expert_intermediate_size=SHARED_INTERMEDIATE,
            num_experts=num_experts,
            norm_topk_prob=False,
            qkv_bias=True,
            mlp_only_layers=[],
            decoder_sparse_step=1,
        )
        kw.update(overrides)
        return Qwen2MoeConfig(**kw)
    if family == "mixtral":
        # Mixtral's intermediate_size *is* the expert intermediate size.
        kw = dict(common, intermediate_size=EXPERT_INTERMEDIATE, num_local_experts=num_experts)
        kw.update(overrides)
        return MixtralConfig(**kw)
    if family == "olmoe":
        # OLMoE's intermediate_size *is* the expert intermediate size; its default
        # eos (50279) lies outside the tiny vocab, the common kwargs fix it.
        kw = dict(
            common,
            intermediate_size=EXPERT_INTERMEDIATE,
            num_experts=num_experts,
            norm_topk_prob=False,
        )
        kw.update(overrides)
        return OlmoeConfig(**kw)
    if family == "gpt_oss":
        from transformers import GptOssConfig

        kw = dict(
            common,
            intermediate_size=EXPERT_INTERMEDIATE,
            num_local_experts=num_experts,
            head_dim=16,
            sliding_window=GPT_OSS_WINDOW,
            swiglu_limit=1.0,
            rope_parameters=dict(GPT_OSS_ROPE),
        )
        kw.update(overrides)
        return GptOssConfig(**kw)
    raise ValueError(f"unknown family {family!r}")


def _model_class(family: str):
    from transformers import (
        GptOssForCausalLM,
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
        "gpt_oss": GptOssForCausalLM,
    }[family]


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Larger-than-default init so routing and logits are not near-ties.

    Norm weights are 1 + noise (so a runtime that ignores them is caught), every
    other parameter (biases included) is N(0, std^2), std = INIT_STD unless
    INIT_STD_OVERRIDES names it.
    """
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
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


_HF_MODELS: dict[str, torch.nn.Module] = {}


def _load_hf(ckpt_dir) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    key = str(Path(ckpt_dir).resolve())
    if key not in _HF_MODELS:
        model = AutoModelForCausalLM.from_pretrained(
            key, dtype=torch.float32, attn_implementation="eager"
        )
        model.eval()
        _HF_MODELS[key] = model
    return _HF_MODELS[key]


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
