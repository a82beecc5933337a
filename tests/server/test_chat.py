"""Chat prompts as HF ``apply_chat_template`` tokenizes them (one BOS), the template's sandbox,
``--chat-template`` files, and the tool-call parsers. No server, no model: a tiny tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitmoe.chat import ChatTemplate, ChatTemplateError
from splitmoe.server.tool_parsers import (
    TOOL_PARSERS,
    ToolCallStream,
    get_tool_parser,
)
from splitmoe.tokenizer import Tokenizer

BOS, EOT = "<|begin_of_text|>", "<|eot_id|>"
SPECIAL = [BOS, "<|start_header_id|>", "<|end_header_id|>", EOT, "<tool_call>", "</tool_call>"]

# Llama 3's shape: the template writes BOS itself, while the tokenizer's post-processor adds one
# to any text encoded with special tokens. Tools, tool calls and a Qwen3-style enable_thinking
# flag print something so that tests see them arrive.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|start_header_id|>system<|end_header_id|>\n\nTools:' }}"
    "{% for t in tools %}{{ ' ' + t.function.name }}{% endfor %}{{ '<|eot_id|>' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message.tool_calls is defined %}{% for c in message.tool_calls %}"
    "{{ '<tool_call>' + c.function.name + ':' + c.function.arguments.city + '</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}"
    "{% endif %}{% endif %}"
)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there!"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """tokenizer.json (character-level, BOS added by a TemplateProcessing post-processor) and
    tokenizer_config.json (bos_token, eos_token, chat_template) in a fresh directory."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, processors

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for c in [chr(c) for c in range(32, 127)] + ["\n"]:
        vocab.setdefault(c, len(vocab))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.add_special_tokens(SPECIAL)
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    out = tmp_path_factory.mktemp("llama3_tok")
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOT,
        "chat_template": LLAMA3_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpt))


@pytest.fixture(scope="module")
def ours(ckpt):
    return Tokenizer.from_checkpoint(ckpt), ChatTemplate.from_checkpoint(ckpt)


def _hf_ids(hf, messages, **kw) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_fixture_tokenizer_adds_bos(ckpt, hf, ours):
    tok, _ = ours
    bos = hf.convert_tokens_to_ids(BOS)
    assert hf("Hi")["input_ids"][0] == bos
    assert tok.encode("Hi")[0] == bos and tok.encode("Hi").count(bos) == 1
    assert bos not in tok.encode("Hi", add_special_tokens=False)


def test_prompt_ids_one_bos_and_match_hf(hf, ours):
    tok, template = ours
    bos = hf.convert_tokens_to_ids(BOS)
    ids = template.prompt_ids(tok, MESSAGES, add_generation_prompt=True)
    assert ids.count(bos) == 1 and ids[0] == bos
    assert ids == _hf_ids(hf, MESSAGES, add_generation_prompt=True)
    # the double BOS this replaces: the rendered text encoded with special tokens added
    assert tok.encode(template.render(MESSAGES))[:2] == [bos, bos]

    no_gen = template.prompt_ids(tok, MESSAGES, add_generation_prompt=False)
    assert no_gen == _hf_ids(hf, MESSAGES, add_generation_prompt=False)
    assert len(no_gen) < len(ids)


@pytest.mark.parametrize("prefix", ["The answer is", "The answer is "])
def test_continue_final_message_matches_hf(hf, ours, prefix):
    tok, template = ours
    messages = [*MESSAGES, {"role": "assistant", "content": prefix}]
    text = template.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("The answer is") and EOT not in text.split("assistant")[-1]
    want = _hf_ids(hf, messages, add_generation_prompt=False, continue_final_message=True)
    got = template.prompt_ids(
        tok, messages, add_generation_prompt=False, continue_final_message=True
    )
    assert got == want


def test_continue_final_message_and_generation_prompt_conflict(ours):
    tok, template = ours
    messages = [*MESSAGES, {"role": "assistant", "content": "Sure"}]
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        template.prompt_ids(tok, messages, add_generation_prompt=True, continue_final_message=True)


def test_tools_and_template_kwargs_reach_the_template(hf, ours):
    tok, template = ours
    text = template.render(MESSAGES, tools=TOOLS)
    assert "Tools: get_weather get_time" in text
    assert template.prompt_ids(tok, MESSAGES, tools=TOOLS) == _hf_ids(
        hf, MESSAGES, tools=TOOLS, add_generation_prompt=True
    )
    kw = {"enable_thinking": False}
    text = template.render(MESSAGES, chat_template_kwargs=kw)
    assert text.endswith("<think></think>")
    assert "<think>" not in template.render(
        MESSAGES, chat_template_kwargs={"enable_thinking": True}
    )
    assert template.prompt_ids(tok, MESSAGES, chat_template_kwargs=kw) == _hf_ids(
        hf, MESSAGES, add_generation_prompt=True, enable_thinking=False
    )


def test_assistant_tool_call_arguments_reach_the_template_as_objects(hf, ours):
    tok, template = ours
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    as_text = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,  # (what OpenAI clients send beside tool_calls)
            "tool_calls": [
                {**call, "function": {**call["function"], "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    as_dict = json.loads(json.dumps(as_text))
    as_dict[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Oslo"}
    assert "<tool_call>get_weather:Oslo</tool_call>" in template.render(as_text)
    assert template.prompt_ids(tok, as_text) == _hf_ids(hf, as_dict, add_generation_prompt=True)
    bad = json.loads(json.dumps(as_text))
    bad[2]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(ChatTemplateError, match="not JSON text"):
        template.render(bad)


@pytest.mark.parametrize(
    "kwargs", [{"messages": []}, {"add_generation_prompt": False}, {"tools": []}, {"bos_token": ""}]
)
def test_template_kwargs_cannot_replace_reserved_variables(ours, kwargs):
    _, template = ours
    with pytest.raises(ChatTemplateError, match=f"cannot set {next(iter(kwargs))}"):
        template.render(MESSAGES, chat_template_kwargs=kwargs)


@pytest.mark.parametrize(
    "messages",
    [[], "hello", [{"role": "user", "content": "x"}, 3]],
)
def test_bad_messages_are_template_errors(ours, messages):
    _, template = ours
    with pytest.raises(ChatTemplateError):
        template.render(messages)


def test_template_errors_are_chat_template_errors():
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        t.render(MESSAGES)
    t = ChatTemplate("{{ messages[0]['content'] + 1 }}")
    with pytest.raises(ChatTemplateError, match="TypeError"):
        t.render(MESSAGES)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.system('true') }}",
        "{{ joiner.__init__.__globals__['__builtins__']['__import__']('os') }}",
        "{{ messages.append({'role': 'user'}) }}",
        "{% set ns = namespace(_x=1) %}{{ ns }}",
        "{{ dict.__class__ }}{{ dict.__class__.__mro__ }}",
    ],
)
def test_template_stays_in_the_sandbox(source):
    with pytest.raises(ChatTemplateError, match="unsafe operation"):
        ChatTemplate(source).render(MESSAGES)


def test_from_file(tmp_path, ckpt, ours):
    tok, template = ours
    f = tmp_path / "t.jinja"
    f.write_text(LLAMA3_TEMPLATE)
    from_file = ChatTemplate.from_file(f, ckpt)
    assert from_file.special_tokens["bos_token"] == BOS
    assert from_file.prompt_ids(tok, MESSAGES) == template.prompt_ids(tok, MESSAGES)
    assert ChatTemplate.from_file(str(f)).render(MESSAGES).startswith("<|start_header_id|>")
    literal = ChatTemplate.from_file("{% for m in messages %}{{ m.content }}{% endfor %}", ckpt)
    assert literal.render(MESSAGES) == "Be brief.Hi there!"
    with pytest.raises(ValueError, match="neither a readable file"):
        ChatTemplate.from_file(tmp_path / "missing.jinja", ckpt)
    bad = tmp_path / "bad.jinja"
    bad.write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ValueError, match="cannot read"):
        ChatTemplate.from_file(bad, ckpt)
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        ChatTemplate.from_file(empty, ckpt)


# ---- tool-call parsers ----------------------------------------------------------------------


def _calls(result) -> list[tuple[str, dict]]:
    for c in result.tool_calls:
        assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) > 10
        assert isinstance(c["function"]["arguments"], str)
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.tool_calls
    ]


def test_hermes_one_call():
    p = get_tool_parser("hermes")
    r = p.parse(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert r.content is None
    assert _calls(r) == [("get_weather", {"city": "Paris"})]


def test_hermes_two_calls_with_text_around():
    p = get_tool_parser("hermes")
    text = (
        "Let me check.\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
        "</tool_call>\n"
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
        " Done."
    )
    r = p.parse(text)
    assert _calls(r) == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    assert r.content == "Let me check.\n\n Done."
    assert len({c["id"] for c in r.tool_calls}) == 2


def test_hermes_malformed_blocks_stay_content():
    p = get_tool_parser("hermes")
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    r = p.parse(bad)
    assert r.content == bad and r.tool_calls == []
    for body in ('{"arguments": {}}', "[1, 2]", '{"name": "f", "arguments": 3}', "x" * 5):
        r = p.parse(f"<tool_call>{body}</tool_call>")
        assert r.content == f"<tool_call>{body}</tool_call>" and r.tool_calls == []
    mixed = bad + '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    r = p.parse(mixed)
    assert r.content == bad and _calls(r) == [("get_time", {})]
    deep = "<tool_call>" + "[" * 100000 + "</tool_call>"
    assert p.parse(deep).content == deep


def test_hermes_no_call_and_lenient_forms():
    p = get_tool_parser("hermes")
    assert p.parse("Just text.").content == "Just text."
    assert p.parse("Just text.").tool_calls == []
    assert p.parse("").content is None
    # a final call the model stopped after without its closing tag
    r = p.parse('Ok <tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert r.content == "Ok " and _calls(r) == [("f", {"a": 1})]
    r = p.parse('<tool_call>{"name": "f", "parameters": {"a": "é"}}</tool_call>')
    assert _calls(r) == [("f", {"a": "é"})] and "é" in r.tool_calls[0]["function"]["arguments"]
    r = p.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert _calls(r) == [("f", {"a": 1})]


def test_glm45_calls_use_declared_string_types():
    p = get_tool_parser("glm45")
    text = (
        "Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
    )
    assert _calls(p.parse(text, TOOLS)) == [("get_weather", {"city": "123", "days": 2})]
    assert _calls(p.parse(text)) == [("get_weather", {"city": 123, "days": 2})]
    assert p.parse(text).content == "Checking."
    r = p.parse("<tool_call>get_time</tool_call>")
    assert _calls(r) == [("get_time", {})] and r.content is None
    junk = "<tool_call>get_time junk <b>x</b></tool_call>"
    assert p.parse(junk).content == junk


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_stream_gives_the_same_content_and_calls(name):
    p = get_tool_parser(name)
    body = (
        '{"name": "get_time", "arguments": {"tz": "UTC"}}'
        if name == "hermes"
        else "get_time\n<arg_key>tz</arg_key><arg_value>UTC</arg_value>"
    )
    texts = [
        f"Sure, one moment <tool_c and more <tool_call>{body}</tool_call> after",
        f"<tool_call>{body}</tool_call>",
        "No tools here, just < and <tool_ text",
        f"<tool_call>{body}",
    ]
    for text in texts:
        whole = p.parse(text)
        s = ToolCallStream(p)
        sent = "".join(s.feed(text[i : i + 3]) for i in range(0, len(text), 3))
        assert "<tool_call>" not in sent
        end = s.finish()
        assert sent + (end.content or "") == (whole.content or "")
        assert _calls(end) == _calls(whole)


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'.*glm45, hermes"):
        get_tool_parser("nope")
