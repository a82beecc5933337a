"""The built-in default model: a small Qwen3-MoE checkpoint written locally, nothing downloaded.

``python -m splitmoe.models.default_model --out DIR`` writes ``config.json``,
``model.safetensors`` (deterministic random weights) and a byte-level BPE ``tokenizer.json``
trained on a short built-in text. Its generations are gibberish, but every part of the runtime
(tokenizer, routing, dispatch/combine, paged KV) does real work on it.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

EOS = "<|endoftext|>"

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


def write_default_model(out: str | Path, seed: int = 0, **overrides) -> Path:
    """Writes the default checkpoint to ``out`` (created if needed) and returns its path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**DEFAULT_CONFIG, **overrides}
    tok = build_tokenizer(cfg["vocab_size"])
    if tok.get_vocab_size() > cfg["vocab_size"]:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens > vocab {cfg['vocab_size']}")
    cfg["eos_token_id"] = tok.token_to_id(EOS)
    tok.save(str(out / "tokenizer.json"))
    save_file(build_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": cfg["eos_token_id"]}, indent=2) + "\n"
    )
    return out


DEFAULT_PATH = Path(".splitmoe/default-model")


def default_model_path(path: str | Path = DEFAULT_PATH) -> str:
    """The default model's directory (under the current directory), written on first use: what
    the scripts run when no ``--model`` is given."""
    path = Path(path)
    if not (path / "config.json").is_file():
        write_default_model(path)
    return str(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory to write the checkpoint to")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = write_default_model(args.out, seed=args.seed)
    print(f"wrote the default Qwen3-MoE checkpoint to {path}")


if __name__ == "__main__":
    main()
