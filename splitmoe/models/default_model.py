"""The built-in models: small Qwen3-MoE checkpoints written locally, nothing downloaded.

``python -m splitmoe.models.default_model --out DIR [--preset realistic]`` writes
``config.json``, ``model.safetensors`` (deterministic random weights), a byte-level BPE
``tokenizer.json`` trained on a short built-in text and a ``tokenizer_config.json`` with a
ChatML chat template (what the server's chat endpoint renders). Their generations are
gibberish, but every part of the runtime (tokenizer, routing, dispatch/combine, paged KV) does
real work on them.

Presets: ``"default"`` (H 128, 16 experts, 4 layers: ~7 MB, for tests and quick runs) and
``"realistic"`` (H 512, 32 experts top-4 of I 256, 6 layers, 8 / 2 heads of 64, vocab 4096:
~330 MB float32, of which 302 MB are routed experts), the smallest shape on which speed-ups are
kept (STYLE.md: hidden >= 512, >= 32 experts, >= 6 layers). At decode batch 32 nearly every
expert is hit each step, so a step reads ~300 MB: bound by the CPU's memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

EOS = "<|endoftext|>"
# ChatML, as Qwen's checkpoints use it (without their tool and reasoning parts)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

DEFAULT_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 2048,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "bos_token_id": None,
    "eos_token_id": 0,
    "torch_dtype": "float32",
}

REALISTIC_CONFIG = {
    **DEFAULT_CONFIG,
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "max_position_embeddings": 4096,
}

PRESETS = {"default": DEFAULT_CONFIG, "realistic": REALISTIC_CONFIG}

_CORPUS = """
Mixture-of-Experts language models route every token to a few experts out of many. Attention
keeps a cache of keys and values for every request, and grows with the context; experts hold most
of the weights, and their cost depends on how many tokens arrive at once. Splitting attention and
experts onto separate ranks lets each pool be sized for its own bottleneck. Tokens travel from
attention ranks to expert ranks and back in every layer, so communication must be fast, batched
and overlapped with computation. A load balancer picks among replicas of hot experts so that the
busiest rank does not set the pace for everyone. The quick brown fox jumps over the lazy dog.
Hello, world! Once upon a time, a small model wrote its first words: one, two, three, four, five.
"""


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok


def build_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    d, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    E, Im = cfg["num_experts"], cfg["moe_intermediate_size"]

    def w(*shape: int) -> torch.Tensor:  # fan-in scaled, so activations stay O(1) through layers
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    t = {"model.embed_tokens.weight": torch.randn(V, H, generator=g), "lm_head.weight": w(V, H)}
    t["model.norm.weight"] = norm(H)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = norm(H)
        t[f"{p}.post_attention_layernorm.weight"] = norm(H)
        t[f"{p}.self_attn.q_proj.weight"] = w(nh * d, H)
        t[f"{p}.self_attn.k_proj.weight"] = w(nkv * d, H)
        t[f"{p}.self_attn.v_proj.weight"] = w(nkv * d, H)
        t[f"{p}.self_attn.o_proj.weight"] = w(H, nh * d)
        t[f"{p}.self_attn.q_norm.weight"] = norm(d)
        t[f"{p}.self_attn.k_norm.weight"] = norm(d)
        t[f"{p}.mlp.gate.weight"] = w(E, H)
        for e in range(E):
            t[f"{p}.mlp.experts.{e}.gate_proj.weight"] = w(Im, H)
            t[f"{p}.mlp.experts.{e}.up_proj.weight"] = w(Im, H)
            t[f"{p}.mlp.experts.{e}.down_proj.weight"] = w(H, Im)
    return {k: v.contiguous() for k, v in t.items()}


def write_default_model(
    out: str | Path, seed: int = 0, preset: str = "default", **overrides
) -> Path:
    """Writes the ``preset`` checkpoint (`PRESETS`), with config ``overrides``, to ``out``
    (created if needed) and returns its path. The BPE tokenizer learns what the built-in text
    holds (~600 tokens), fewer than a large vocab: the other ids are valid, never produced by
    encoding."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; use one of {sorted(PRESETS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**PRESETS[preset], **overrides}
    tok = build_tokenizer(cfg["vocab_size"])
    if tok.get_vocab_size() > cfg["vocab_size"]:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens > vocab {cfg['vocab_size']}")
    cfg["eos_token_id"] = tok.token_to_id(EOS)
    tok.save(str(out / "tokenizer.json"))
    write_tokenizer_config(out)
    save_file(build_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": cfg["eos_token_id"]}, indent=2) + "\n"
    )
    return out


def write_tokenizer_config(out: Path) -> None:
    config = {"eos_token": EOS, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


DEFAULT_PATH = Path(".splitmoe/default-model")
REALISTIC_PATH = Path(".splitmoe/realistic-model")


def default_model_path(path: str | Path = DEFAULT_PATH) -> str:
    """The default model's directory (under the current directory), written on first use: what
    the scripts run when no ``--model`` is given."""
    return _preset_path(path, "default")


def realistic_model_path(path: str | Path = REALISTIC_PATH) -> str:
    """The realistic preset's directory (under the current directory), written on first use
    (~2 s): what ``--model realistic`` of the benchmarks runs."""
    return _preset_path(path, "realistic")


def _preset_path(path: str | Path, preset: str) -> str:
    path = Path(path)
    if not (path / "config.json").is_file():
        write_default_model(path, preset=preset)
    elif not (path / "tokenizer_config.json").is_file():  # (written before it had one)
        write_tokenizer_config(path)
    return str(path)


def resolve_model(model: str | None) -> str:
    """A script's ``--model``: a preset name (``"default"``, ``"realistic"``; None: the default),
    written on first use, or a checkpoint directory as it is."""
    if model is None or model == "default":
        return default_model_path()
    if model == "realistic":
        return realistic_model_path()
    return model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory to write the checkpoint to")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    args = ap.parse_args(argv)
    path = write_default_model(args.out, seed=args.seed, preset=args.preset)
    print(f"wrote the {args.preset} Qwen3-MoE checkpoint to {path}")


if __name__ == "__main__":
    main()
