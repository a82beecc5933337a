"""Kimi-K2 as released: ``model_type: kimi_k2`` (DeepSeek-V3's architecture), FP8 weights, and a
tiktoken tokenizer (``tiktoken.model`` + ``tokenizer_config.json``, no ``tokenizer.json``).

The tiny checkpoint takes the config keys of Kimi-K2's ``config.json`` (shapes from a tiny
DeepSeek-V3) and a tokenizer with Kimi's special-token layout written here. transformers has no
``kimi_k2`` model type, so the oracle is HF's DeepSeek-V3 on the same weights dequantized."""

from __future__ import annotations

import base64
import json

import pytest
from tiny_models import hf_greedy, make_tiny_checkpoint, quantize_fp8_checkpoint

from splitmoe import LLM, SamplingParams
from splitmoe.chat import ChatTemplate
from splitmoe.models.config import ModelConfig
from splitmoe.sim.model import CONFIG_DIR
from splitmoe.tokenizer import TiktokenTokenizer, Tokenizer

# byte-level BPE: the 256 bytes, then a few merges (rank order is merge order)
MERGES = [b"he", b"ll", b"llo", b"hello", b" w", b"or", b"orl", b"orld", b" world", b"is",
          b" is", b"Ki", b"mi", b"Kimi", b"\xe4\xbd", b"\xe4\xbd\xa0"]  # fmt: skip
BASE = 256 + len(MERGES)
VOCAB = BASE + TiktokenTokenizer.NUM_RESERVED  # as Kimi-K2: 163584 ranks + 256 = 163840
# Kimi-K2's special tokens at their offsets from the end of the BPE ranks
SPECIAL = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
           6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
           17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}  # fmt: skip
# Kimi-K2's chat template, its tool and multi-part branches left out
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
    "<|im_end|>"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
MAX_TOKENS = 8


def _write_tokenizer(out) -> None:
    tokens = [bytes([b]) for b in range(256)] + MERGES
    (out / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens))
    )
    added = {
        str(BASE + off): {"content": name, "lstrip": False, "normalized": False,
                          "rstrip": False, "single_word": False, "special": True}
        for off, name in SPECIAL.items()
    }  # fmt: skip
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "added_tokens_decoder": added,
                "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                                              "<|im_system|>", "<|im_middle|>"],
                "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
                "bos_token": "[BOS]",
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
                "eos_token": "[EOS]",
                "extra_special_tokens": {},
                "model_max_length": 1048576,
                "pad_token": "[PAD]",
                "tokenizer_class": "TikTokenTokenizer",
                "unk_token": "[UNK]",
            },
            indent=2,
        )
    )  # fmt: skip


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(the kimi_k2 checkpoint, the same weights dequantized as a deepseek_v3 HF checkpoint)."""
    root = tmp_path_factory.mktemp("kimi_k2")
    src = make_tiny_checkpoint(
        "deepseek_v3", root / "src", vocab_size=VOCAB, bos_token_id=BASE, eos_token_id=BASE + 1,
        pad_token_id=BASE + 255, with_tokenizer=False,
    )  # fmt: skip
    ckpt, deq = quantize_fp8_checkpoint(src, root / "kimi", root / "deq", block=(16, 16))
    hf = json.loads((ckpt / "config.json").read_text())
    release = json.loads((CONFIG_DIR / "kimi-k2.json").read_text())
    # Kimi-K2's keys, with the tiny model's values; its YaRN as rope_scaling + rope_theta
    cfg = {k: hf.get(k, v) for k, v in release.items()}
    rope = dict(hf["rope_parameters"])
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    cfg.update(model_type="kimi_k2", torch_dtype="float32")
    assert cfg["quantization_config"]["weight_block_size"] == [16, 16]
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=2))
    _write_tokenizer(ckpt)
    assert not (ckpt / "tokenizer.json").exists()
    return ckpt, deq


def test_kimi_k2_config_is_deepseek_v3(kimi):
    ckpt, deq = kimi
    k2, v3 = ModelConfig.from_hf(ckpt), ModelConfig.from_hf(deq)
    assert k2.model_type == "kimi_k2" and v3.model_type == "deepseek_v3"
    same = ("topk_method", "scoring_func", "router_bias", "kv_lora_rank", "q_lora_rank",
            "rope_type", "rope_scaling", "rope_interleave", "moe_layers", "n_group")  # fmt: skip
    assert {f: getattr(k2, f) for f in same} == {f: getattr(v3, f) for f in same}
    assert k2.quantization == "fp8" and k2.eos_token_ids == (BASE + 1,)


def test_tiktoken_tokenizer_reads_kimi_layout(kimi):
    tok = Tokenizer.from_checkpoint(kimi[0])
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.encode("hello world") == [256 + MERGES.index(b"hello"),
                                         256 + MERGES.index(b" world")]  # fmt: skip
    # special-token text encodes as the special token; decode leaves specials out
    ids = tok.encode("<|im_user|>Kimi<|im_end|>", add_special_tokens=False)
    assert ids == [BASE + 3, 256 + MERGES.index(b"Kimi"), BASE + 2]
    assert tok.decode(ids) == "Kimi" and tok.decode_token(BASE + 2) == "<|im_end|>"
    assert tok.encode(f"<|reserved_token_{BASE + 5}|>") == [BASE + 5]
    text = "你好 Kimi, it's 2025!\n\n  x"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("a" * 60_000)) == "a" * 60_000  # (cut into runs)


def test_kimi_k2_generates_from_text_and_chat(kimi):
    ckpt, deq = kimi
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(ckpt), attention_ranks=1, expert_ranks=1, dtype="float32", device="cpu") as llm:
        tok = llm.tokenizer
        prompt = "hello world, Kimi is"
        out = llm.generate(prompt, params)[0]
        assert out.token_ids == hf_greedy(deq, tok.encode(prompt), MAX_TOKENS)
        assert out.text == tok.decode(out.token_ids)
        template = ChatTemplate.from_checkpoint(ckpt)
        messages = [{"role": "user", "content": "hello"}]
        assert template.render(messages, add_generation_prompt=True) == (
            "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot "
            "AI.<|im_end|><|im_user|>user<|im_middle|>hello<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>"
        )
        ids = template.prompt_ids(tok, messages)
        assert ids[0] == BASE + 10 and ids[-1] == BASE + 17  # <|im_system|> ... <|im_middle|>
        assert ids.count(BASE + 3) == 1 and 256 + MERGES.index(b"hello") in ids
        chat = llm.generate([ids], params)[0]
        assert chat.token_ids == hf_greedy(deq, ids, MAX_TOKENS)
