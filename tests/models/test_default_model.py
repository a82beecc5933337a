"""The built-in default model is a valid Qwen3-MoE checkpoint: HF transformers loads it and
splitmoe generates the same tokens from text prompts."""

from __future__ import annotations

import json

import tiny_models

from splitmoe import LLM, SamplingParams
from splitmoe.models.default_model import write_default_model
from splitmoe.tokenizer import Tokenizer


def test_default_model_matches_hf(tmp_path):
    ckpt = write_default_model(tmp_path / "default")
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"
    tok = Tokenizer.from_checkpoint(ckpt)
    prompts = ["Hello, world!", "Experts"]
    assert tok.decode(tok.encode(prompts[0])) == prompts[0]
    with LLM(str(ckpt), attention_ranks=1, expert_ranks=2, dtype="float32", device="cpu") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.prompt_token_ids == tok.encode(p)
        assert o.token_ids == tiny_models.hf_greedy(ckpt, o.prompt_token_ids, 12)
        assert o.text == tok.decode(o.token_ids)


def test_default_model_is_deterministic(tmp_path):
    a = write_default_model(tmp_path / "a")
    b = write_default_model(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
