"""Structured output (`splitmoe.attention_nodes.grammar`): random logits masked by a JSON schema's
grammar, sampled and accepted until the grammar terminates, must decode to JSON that validates
(`jsonschema`); the vocabulary xgrammar sees is built from tokenizer.json without transformers
and checked against xgrammar's own `TokenizerInfo.from_huggingface` (transformers as the oracle).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from splitmoe.attention_nodes import grammar
from splitmoe.attention_nodes.grammar import (
    JSON_OBJECT_SCHEMA,
    GrammarBackend,
    GrammarState,
    apply_grammar_masks,
    check_json_schema,
)
from splitmoe.models.default_model import write_default_model

# Bounded strings, arrays and numbers, enums, a nested object, every field required: a random
# walk through its grammar ends within a few hundred tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "bc", "def"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 6},
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["city", "zip"],
        },
        "ok": {"type": "boolean"},
        "kind": {"enum": ["x", "y", 1, None]},
    },
    "required": ["name", "age", "tags", "address", "ok", "kind"],
}
MAX_STEPS = 400
_BPE_TEXT = """Attention ranks own the requests and their caches; expert ranks own the experts.
The quick brown fox jumps over the lazy dog. {"name": "value", "list": [1, 2, 3], "ok": true}
Once upon a time, a small model wrote its first words: one, two, three, four, five."""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_default_model(tmp_path_factory.mktemp("grammar") / "default")


@pytest.fixture(scope="module")
def config(ckpt):
    return json.loads((ckpt / "config.json").read_text())


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    return Tokenizer.from_file(str(ckpt / "tokenizer.json"))


@pytest.fixture(scope="module")
def backend(ckpt, config):
    return GrammarBackend.from_checkpoint(ckpt, config["vocab_size"], (config["eos_token_id"],))


def _gpt2_char(byte: int) -> str:
    """The byte-level alphabet's character for ``byte`` (GPT-2's bytes_to_unicode)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    if byte in kept:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in kept].index(byte))


def _allowed(state: GrammarState, vocab_size: int) -> set[int]:
    logits = torch.zeros(1, vocab_size)
    apply_grammar_masks(logits, [state])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def _walk(
    backend: GrammarBackend, schema: str, seed: int, bias: torch.Tensor | None = None
) -> tuple[list[int], GrammarState]:
    """Random logits -> mask -> sample -> accept, until the grammar terminates."""
    g = torch.Generator().manual_seed(seed)
    state, tokens = backend.state(schema), []
    for _ in range(MAX_STEPS):
        if state.terminated:
            return tokens, state
        logits = 2.0 * torch.randn(1, backend.vocab_size, generator=g)  # [1, V]
        if bias is not None:
            logits += bias
        apply_grammar_masks(logits, [state])
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        state.accept(token)
        tokens.append(token)
    raise AssertionError(f"seed {seed}: no complete JSON after {MAX_STEPS} tokens: {tokens}")


@pytest.mark.parametrize("seed", range(20))
def test_random_walks_validate(backend, tokenizer, seed):
    tokens, state = _walk(backend, check_json_schema(SCHEMA), seed)
    assert state.terminated and state.completed
    jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMA)


def test_json_object_schema_gives_objects(backend, tokenizer):
    # Free keys and values run long under uniform logits: tokens that close strings, objects
    # and arrays get a push, as a trained model's would.
    close = [i for t, i in tokenizer.get_vocab().items() if any(c in t for c in '"}]')]
    bias = torch.zeros(backend.vocab_size)
    bias[close] = 3.0
    kinds = set()
    for seed in range(20):
        tokens, _ = _walk(backend, JSON_OBJECT_SCHEMA, seed, bias)
        value = json.loads(tokenizer.decode(tokens))
        assert isinstance(value, dict)
        kinds |= {type(v).__name__ for v in value.values()}
    assert len(kinds) >= 3, kinds  # not only empty objects: values of several types
    for bad in ('"a"', "[1]", "1"):  # anything but an object is refused from its first token
        with pytest.raises(ValueError, match="rejected"):
            backend.state(JSON_OBJECT_SCHEMA).accept(tokenizer.encode(bad).ids[0])


def test_terminated_allows_only_stop_tokens(backend, tokenizer, config):
    eos, V = config["eos_token_id"], config["vocab_size"]
    state = backend.state(check_json_schema({"type": "object"}))
    for t in tokenizer.encode('{"a": [1, {"b": null}]').ids:
        assert not state.terminated
        state.accept(t)
    assert not state.completed
    state.accept(tokenizer.token_to_id("}"))
    assert state.completed and state.terminated
    assert _allowed(state, V) == {eos}
    state.accept(eos)  # a stop token is still accepted; nothing is after it
    assert state.terminated and _allowed(state, V) == {eos}
    with pytest.raises(ValueError, match="JSON is complete"):
        state.accept(tokenizer.token_to_id("}"))

    # A top-level number is complete after a digit but may go on: not terminated.
    state = backend.state(check_json_schema({"type": "integer"}))
    state.accept(tokenizer.token_to_id("1"))
    assert state.completed and not state.terminated
    assert {eos, tokenizer.token_to_id("2")} <= _allowed(state, V)


def test_rejected_token_raises_and_keeps_state(backend, tokenizer, config):
    state = backend.state(check_json_schema(SCHEMA))
    with pytest.raises(ValueError, match="token .* rejected: the grammar does not allow it"):
        state.accept(tokenizer.token_to_id("a"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        state.accept(config["vocab_size"])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        state.accept(-1)
    state.accept(tokenizer.token_to_id("{"))  # the rejected token left nothing behind


def test_mixed_batch_leaves_rows_without_grammar_alone(backend, tokenizer):
    V = backend.vocab_size
    states = [None, backend.state(JSON_OBJECT_SCHEMA), None, backend.state(JSON_OBJECT_SCHEMA)]
    states[3].accept(tokenizer.token_to_id("{"))
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))  # [4, V]
    before = logits.clone()
    apply_grammar_masks(logits, states)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite1 = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert finite1 == [tokenizer.token_to_id("{")]
    assert torch.equal(logits[1, finite1], before[1, finite1])  # allowed logits are unchanged
    assert set(torch.isfinite(logits[3]).nonzero().flatten().tolist()) == _allowed(states[3], V)
    with pytest.raises(ValueError, match="do not match"):
        apply_grammar_masks(logits, states[:3])
    with pytest.raises(ValueError, match="grammar is for"):
        apply_grammar_masks(torch.zeros(1, V + 32), [states[1]])
    apply_grammar_masks(logits, [None] * 4)  # no grammar rows: nothing to do


def test_logits_wider_than_the_tokenizer_never_allow_the_extra_ids(ckpt, tokenizer, config):
    n = tokenizer.get_vocab_size()
    V = n + 45  # padded logits, not a multiple of 32
    backend = GrammarBackend.from_checkpoint(ckpt, V, (config["eos_token_id"],))
    assert backend.vocab_size == V
    # push the extra ids: they must still never come through the mask
    bias = torch.zeros(V)
    bias[n:] = 50.0
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        state = backend.state(check_json_schema(SCHEMA))
        for _ in range(MAX_STEPS):
            if state.terminated:
                break
            logits = torch.randn(2, V, generator=g) + bias  # [2, V]; row 0 without a grammar
            apply_grammar_masks(logits, [None, state])
            assert not torch.isfinite(logits[1, n:]).any()
            assert torch.isfinite(logits[0]).all()
            state.accept(int(torch.multinomial(torch.softmax(logits[1], -1), 1, generator=g)))
        assert state.terminated


def test_no_control_bytes_or_surrogates_in_strings(backend, tokenizer, config):
    """xgrammar 0.2 lets raw control characters into strings with maxLength and surrogate UTF-8
    into any string; neither must come through the masks."""
    V = config["vocab_size"]
    tab, ctrl = tokenizer.token_to_id(_gpt2_char(0x09)), tokenizer.token_to_id(_gpt2_char(0x06))
    for schema in ({"type": "string", "maxLength": 8}, {"type": "string"}):
        state = backend.state(check_json_schema(schema))
        state.accept(tokenizer.token_to_id('"'))
        allowed = _allowed(state, V)
        assert tokenizer.token_to_id("a") in allowed
        assert tab not in allowed and ctrl not in allowed
        # after the UTF-8 lead byte ED, 80-9F continue it (U+D000-D7FF: Hangul), A0-BF would
        # make a UTF-16 surrogate
        state.accept(tokenizer.token_to_id(_gpt2_char(0xED)))
        allowed = _allowed(state, V)
        assert tokenizer.token_to_id(_gpt2_char(0x80)) in allowed
        assert tokenizer.token_to_id(_gpt2_char(0x9F)) in allowed
        assert tokenizer.token_to_id(_gpt2_char(0xA0)) not in allowed
        assert tokenizer.token_to_id(_gpt2_char(0xBF)) not in allowed
        with pytest.raises(ValueError, match="rejected"):  # the mask, not the grammar, refuses
            state.accept(tokenizer.token_to_id("a"))


def test_special_tokens_never_allowed(ckpt, tmp_path, config):
    """A special token's text inside a JSON string would vanish when the output is decoded
    without special tokens: only the stop tokens, and only at the end, come through."""
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>"])
    tok.add_tokens(["<plain>"])  # an added token that is not special is text like any other
    tok.save(str(tmp_path / "tokenizer.json"))
    special, plain = tok.token_to_id("<|im_start|>"), tok.token_to_id("<plain>")
    V = config["vocab_size"] + 32
    backend = GrammarBackend.from_checkpoint(tmp_path, V, (config["eos_token_id"],))
    state = backend.state(JSON_OBJECT_SCHEMA)
    for t in tok.encode('{"k": "').ids:
        state.accept(t)
    allowed = _allowed(state, V)
    assert plain in allowed and special not in allowed
    assert config["eos_token_id"] not in allowed


def _write_byte_fallback_tokenizer(out: Path) -> Path:
    """A SentencePiece-style BPE (Llama, Mistral, Mixtral): "▁" for spaces, a space prepended
    to the text, the 256 byte pieces <0x00>..<0xFF> for what the merges do not cover."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = ["<unk>", "<s>", "</s>"]
    meta = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = meta
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False)
    base.train_from_iterator([_BPE_TEXT] * 4, trainer)
    model = json.loads(base.to_str())["model"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for t in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = meta
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(specials)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out


def test_byte_fallback_walks_validate(tmp_path):
    path = _write_byte_fallback_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    V = tokenizer.get_vocab_size() + 64
    backend = GrammarBackend.from_checkpoint(path, V, (tokenizer.token_to_id("</s>"),))
    for seed in range(5):
        tokens, _ = _walk(backend, check_json_schema(SCHEMA), seed)
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMA)


def test_vocabulary_matches_xgrammars_from_huggingface(ckpt, tmp_path, config):
    """Our TokenizerInfo (tokenizers only) against xgrammar's from_huggingface (transformers):
    same vocabulary type, prefix-space rule and decoded tokens, on the default model's
    byte-level BPE, a SentencePiece-style byte-fallback BPE and the tiny models'
    character-level (raw) tokenizer."""
    import tiny_models
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    tiny_models.write_tiny_tokenizer(tmp_path / "raw")
    byte_fallback = _write_byte_fallback_tokenizer(tmp_path / "bf")
    cases = [
        (ckpt, config["eos_token_id"], 520, xgr.VocabType.BYTE_LEVEL, False),
        (byte_fallback, 2, 704, xgr.VocabType.BYTE_FALLBACK, True),
        (tmp_path / "raw", 2, tiny_models.VOCAB, xgr.VocabType.RAW, False),
    ]
    for path, eos, V, vocab_type, prefix_space in cases:
        ours, decoded = grammar._tokenizer_info(path / "tokenizer.json", V, (eos,))
        hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
        ref = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V, stop_token_ids=[eos])
        assert (ref.vocab_type, ref.add_prefix_space) == (vocab_type, prefix_space), path
        assert (ours.vocab_type, ours.add_prefix_space) == (vocab_type, prefix_space), path
        mine, theirs = ours.decoded_vocab, ref.decoded_vocab
        assert decoded == mine
        assert len(mine) == len(theirs) == V
        # equal but for the tokens we leave out (empty): control bytes and other special tokens
        differ = [i for i in range(V) if mine[i] != theirs[i]]
        assert all(mine[i] == b"" for i in differ)
        assert all(min(theirs[i]) < 0x20 or i < 3 for i in differ), differ
        assert mine[eos] == theirs[eos] != b""


def test_check_json_schema():
    # canonical text keeps the properties' order (the grammar generates them in that order)
    text = check_json_schema('{ "type": "object", "properties": {"z": {}, "a": {}} }')
    assert text == '{"type":"object","properties":{"z":{},"a":{}}}'
    assert check_json_schema(json.loads(text)) == text
    assert check_json_schema(JSON_OBJECT_SCHEMA) == JSON_OBJECT_SCHEMA
    deep = {"type": "integer"}
    for _ in range(grammar.MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    cases = {
        "{not json": "not valid JSON",
        '[{"type": "string"}]': "must be a JSON object, not a JSON list",
        '"string"': "must be a JSON object, not a JSON str",
        '{"type": "strin"}': 'unsupported JSON schema: Unsupported type "strin"',
        '{"$ref": "#/$defs/missing"}': "unsupported JSON schema: .*missing",
        '{"type": "array", "minItems": 3, "maxItems": 1}': "minItems is greater than maxItems",
        '{"type": "string", "pattern": "(("}': "unsupported JSON schema: .*parenthesis",
        '{"type": "number", "minimum": NaN}': "not valid JSON",
        json.dumps(deep): f"deeper than {grammar.MAX_SCHEMA_DEPTH} levels",
        "[" * 100_000: f"deeper than {grammar.MAX_SCHEMA_DEPTH} levels",
        json.dumps({"enum": ["x" * 1000] * 200}): "characters long; the limit is",
    }
    for schema, message in cases.items():
        with pytest.raises(ValueError, match=message) as e:
            check_json_schema(schema)
        assert ".cc" not in str(e.value) and "/" not in str(e.value).split(":", 1)[0], e.value
    for schema in ([{"type": "string"}], 3, None, {"bad": {1, 2}}):
        with pytest.raises(ValueError):
            check_json_schema(schema)


def test_state_checks_the_schema_again(backend):
    with pytest.raises(ValueError, match='unsupported JSON schema: Unsupported type "strin"'):
        backend.state('{"type": "strin"}')
    with pytest.raises(ValueError, match="must be JSON text"):
        backend.state({"type": "object"})
    deep = '{"type":"array","items":' * 3000 + "{}" + "}" * 3000  # xgrammar would not finish
    with pytest.raises(ValueError, match="deeper than"):
        backend.state(deep)


def test_compiled_grammar_cache_is_bounded(ckpt, config):
    backend = GrammarBackend.from_checkpoint(
        ckpt, config["vocab_size"], (config["eos_token_id"],), max_entries=4
    )
    schemas = [check_json_schema({"type": "string", "maxLength": n}) for n in range(1, 11)]
    first = backend.compile(schemas[0])
    assert backend.compile(schemas[0]) is first  # cached
    compiled = []
    for s in schemas[1:]:
        compiled.append(backend.compile(s))
        backend.compile(schemas[0])
    assert backend.cached_schemas == 4
    assert backend.compile(schemas[0]) is first  # kept in use: never the least recently used
    assert backend.compile(schemas[-1]) is compiled[-1]
    assert backend.compile(schemas[1]) is not compiled[0]  # evicted, compiled anew
    # the byte bound holds too: one byte keeps only the newest grammar
    tight = GrammarBackend.from_checkpoint(
        ckpt, config["vocab_size"], (config["eos_token_id"],), max_bytes=1
    )
    for s in schemas:
        tight.compile(s)
    assert tight.cached_schemas == 1


def test_from_checkpoint_checks_its_inputs(ckpt, tmp_path, config):
    V, eos = config["vocab_size"], config["eos_token_id"]
    with pytest.raises(ValueError, match="tokenizer.json does not exist"):
        GrammarBackend.from_checkpoint(tmp_path, V, (eos,))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        GrammarBackend.from_checkpoint(ckpt, V, (V,))
    with pytest.raises(ValueError, match="EOS token ids"):
        GrammarBackend.from_checkpoint(ckpt, V, ())
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load"):
        GrammarBackend.from_checkpoint(tmp_path, V, (eos,))
