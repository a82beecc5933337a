"""Tool-call parsers are linear in what the model wrote (`splitmoe.server.tool_parsers`).

Model output is as hostile as a client's body. The glm45 parser's argument regex was cubic:
``<tool_call>f`` + ``<arg_key>k</arg_key><arg_value>`` x 300 (10 KB) took 5.3 s, x 1000 about
100 s, on the event loop. Each input here is timed at 256 KB and 1 MB, whole and streamed in
4-character chunks (the best of 3 runs), in a child process with a deadline (a quadratic or
cubic parser would not finish: the test fails in minutes rather than hanging for hours).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from splitmoe.server.tool_parsers import Glm45ToolParser, HermesToolParser, ToolCallStream

# (name, unit repeated up to the size): unclosed tags of every kind, and many small calls
ADVERSARIAL = {
    "arg_value_unclosed": "<arg_key>k</arg_key><arg_value>",
    "arg_key_unclosed": "<arg_key>k<arg_key>",
    "pairs_then_junk": "<arg_key>k</arg_key><arg_value>1</arg_value> ",
    "starts_only": "<tool_call>",
    "start_prefixes": "<tool_ca",
    "many_calls": "<tool_call>f<arg_key>k</arg_key><arg_value>[1]</arg_value></tool_call>",
    "deep_values": "<tool_call>f<arg_key>k</arg_key><arg_value>" + "[" * 2000 + "</arg_value>",
}
SIZES = (256 * 1024, 1024 * 1024)

_CHILD = textwrap.dedent(
    """
    import json, sys, time
    from splitmoe.server.tool_parsers import get_tool_parser, ToolCallStream

    cases, sizes = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    out = {}
    for parser in ("glm45", "hermes"):
        p = get_tool_parser(parser)
        for name, unit in cases.items():
            for size in sizes:
                text = "<tool_call>f" + unit * (size // len(unit))
                best = [float("inf"), float("inf")]  # (the best of 3: a loaded machine's noise)
                for _ in range(3):
                    t = time.perf_counter()
                    p.parse(text)
                    best[0] = min(best[0], time.perf_counter() - t)
                    t = time.perf_counter()
                    s = ToolCallStream(p)
                    for i in range(0, len(text), 4):
                        s.feed(text[i : i + 4])
                    s.finish()
                    best[1] = min(best[1], time.perf_counter() - t)
                out[f"{parser}/{name}/{size}"] = best
    print(json.dumps(out))
    """
)


def test_parsers_are_linear_on_adversarial_text():
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(ADVERSARIAL), json.dumps(SIZES)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    times = json.loads(done.stdout)
    slow = []
    for key in {k.rsplit("/", 1)[0] for k in times}:
        small, big = times[f"{key}/{SIZES[0]}"], times[f"{key}/{SIZES[1]}"]
        for mode, a, b in zip(("whole", "streamed"), small, big):
            # 1 MB within 2 s, and 4x the text within 10x the time (linear is 4x, quadratic
            # 16x) unless 1 MB took under 0.2 s (too quick to tell: quadratic here is seconds)
            if b > 2.0 or (b > 0.2 and b > 10 * a):
                slow.append(f"{key} {mode}: {a:.3f} s at 256 KB, {b:.3f} s at 1 MB")
    assert not slow, (slow, times)


def test_glm45_reads_pairs_and_refuses_anything_else():
    p = Glm45ToolParser()
    (call,) = p.parse(
        "<tool_call>f\n<arg_key> a </arg_key>\n<arg_value>[1, 2]</arg_value>"
        "<arg_key>b</arg_key><arg_value>x < y</arg_value>\n</tool_call>"
    ).tool_calls
    assert json.loads(call["function"]["arguments"]) == {"a": [1, 2], "b": "x < y"}
    for body in (
        "f<arg_key>k</arg_key><arg_value>1",  # (the value never closed)
        "f<arg_key>k</arg_key>junk<arg_value>1</arg_value>",
        "f<arg_key>k</arg_key><arg_value>1</arg_value>junk",
        "f<arg_key>k<arg_value>1</arg_value>",
    ):
        text = f"<tool_call>{body}</tool_call>"
        assert p.parse(text).tool_calls == [] and p.parse(text).content == text, body


@pytest.mark.parametrize(
    "value",
    ["1" * 5000, "1e999", "NaN", "[" * 5000 + "]" * 5000],
    ids=["5000 digits", "1e999", "NaN", "5000 levels"],
)
def test_values_json_cannot_hold_stay_text_or_refuse_the_call(value):
    """An integer of 5000 digits (int() refuses it: a ValueError that was a 500), a number past
    float's range or NaN (not JSON), nesting past the recursion limit: never an exception."""
    r = Glm45ToolParser().parse(f"<tool_call>f<arg_key>k</arg_key><arg_value>{value}</arg_value>")
    (call,) = r.tool_calls
    assert json.loads(call["function"]["arguments"]) == {"k": value}
    hermes = HermesToolParser()
    text = f'<tool_call>{{"name": "f", "arguments": {{"k": {value}}}}}</tool_call>'
    assert hermes.parse(text).tool_calls == [] and hermes.parse(text).content == text


def test_a_stream_keeps_only_a_few_characters_unsent():
    s = ToolCallStream(HermesToolParser())
    sent = "".join(s.feed(c) for c in "plain text <tool_c")
    assert sent == "plain text " and s.feed("x") == "<tool_cx"
    assert s.feed("<tool_call>") == "" and s.feed(" anything") == ""
    assert s.finish().content == "<tool_call> anything"
