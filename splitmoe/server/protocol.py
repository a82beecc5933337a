"""OpenAI's request and response shapes for ``/v1/completions`` and ``/v1/chat/completions``:
request bodies checked field by field into `SamplingParams` (every problem a `BadRequest` that
names the field), and the JSON of responses and stream chunks."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from splitmoe.outputs import RequestOutput
from splitmoe.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20  # (OpenAI's limit for chat; 5 for completions, allowed up to this here)


class BadRequest(ValueError):
    """A 400: ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


class _Fields:
    """Typed reads of a request body's fields."""

    def __init__(self, body: dict):
        self.body = body

    def get(self, name: str, check, what: str, default=None):
        value = self.body.get(name)
        if value is None:
            return default
        if not check(value):
            raise BadRequest(f"'{name}' must be {what}; got {value!r}", name)
        return value

    def int(self, name, default=None, lo=None, hi=None):
        value = self.get(name, _is_int, "an integer", default)
        if value is not None:
            if lo is not None and value < lo:
                raise BadRequest(f"'{name}' must be >= {lo}; got {value}", name)
            if hi is not None and value > hi:
                raise BadRequest(f"'{name}' must be <= {hi}; got {value}", name)
        return value

    def number(self, name, default=None):
        return self.get(name, _is_number, "a number", default)

    def bool(self, name, default=False):
        return self.get(name, lambda v: isinstance(v, bool), "true or false", default)


@dataclass(frozen=True)
class Sampling:
    """What both endpoints share: the sequences' params, ``n`` copies of each prompt, streaming."""

    params: list[SamplingParams]  # one per copy (n), seeds differing
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    max_tokens_given: bool
    return_token_ids: bool  # (vLLM's extension: each choice's token ids)


def parse_sampling(body: dict, chat: bool, default_max_tokens: int) -> Sampling:
    f = _Fields(body)
    max_tokens = f.int("max_tokens", lo=1)
    if chat:
        max_tokens = f.int("max_completion_tokens", max_tokens, lo=1)
    given = max_tokens is not None
    if max_tokens is None:
        max_tokens = default_max_tokens
    temperature = f.number("temperature", 1.0)
    if temperature < 0:
        raise BadRequest(f"'temperature' must be >= 0; got {temperature}", "temperature")
    top_p = f.number("top_p", 1.0)
    if not 0 < top_p <= 1:
        raise BadRequest(f"'top_p' must be in (0, 1]; got {top_p}", "top_p")
    top_k = f.int("top_k", -1)
    if top_k == 0 or top_k < -1:
        raise BadRequest(f"'top_k' must be -1 (off) or >= 1; got {top_k}", "top_k")
    seed = f.int("seed", lo=0)
    n = f.int("n", 1, lo=1, hi=128)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
    ):
        raise BadRequest("'stop' must be a non-empty string or a list of them", "stop")
    stop_ids = f.get(
        "stop_token_ids",
        lambda v: isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v),
        "a list of non-negative integers",
        [],
    )
    ignore_eos = f.bool("ignore_eos")
    stream = f.bool("stream")
    opts = f.get("stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadRequest("'stream_options.include_usage' must be true or false", "stream_options")
    if chat:
        want = f.bool("logprobs")
        top = f.int("top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        if top is not None and not want:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = f.int("logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    for name in ("presence_penalty", "frequency_penalty"):
        if f.number(name, 0.0) != 0:
            raise BadRequest(f"'{name}' is not supported; leave it 0", name)
    if f.bool("echo"):
        raise BadRequest("'echo' is not supported", "echo")
    if body.get("best_of") not in (None, 1, n):
        raise BadRequest("'best_of' is not supported", "best_of")
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=float(temperature),
            top_k=top_k,
            top_p=float(top_p),
            seed=None if seed is None else seed + i,
            stop_token_ids=tuple(stop_ids),
            ignore_eos=ignore_eos,
            stop=tuple(stop or ()),
            logprobs=logprobs,
        )
        for i in range(n)
    ]
    return Sampling(params, n, stream, include_usage, logprobs, given, f.bool("return_token_ids"))


def parse_prompts(body: dict) -> list[str | list[int]]:
    """A completion's ``prompt``: a string, a list of strings, token ids, or lists of them."""
    p = body.get("prompt")
    if p is None:
        raise BadRequest("'prompt' is required", "prompt")
    if isinstance(p, str):
        p = [p]
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        p = [p]
    if not isinstance(p, list) or not p:
        raise BadRequest(
            "'prompt' must be a non-empty string, a list of strings, a list of token ids or a "
            "list of lists of token ids",
            "prompt",
        )
    for i, x in enumerate(p):
        if isinstance(x, str):
            if not x:
                raise BadRequest(f"prompt {i} is empty; every prompt needs text", "prompt")
        elif isinstance(x, list):
            if not x:
                raise BadRequest(f"prompt {i} is empty; every prompt needs tokens", "prompt")
            if not all(_is_int(t) for t in x):
                raise BadRequest(f"prompt {i} has non-integer token ids", "prompt")
        else:
            raise BadRequest(
                f"prompt {i} is a {type(x).__name__}; use a string or a list of token ids",
                "prompt",
            )
    return p


def parse_messages(body: dict) -> list[dict]:
    """Chat ``messages`` with their content as plain text (text parts joined)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"message {i} must be an object with a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise BadRequest(
                        f"message {i}: only text content parts are supported", "messages"
                    )
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise BadRequest(f"message {i}: 'content' must be a string or a list", "messages")
        out.append({**m, "content": content})
    return out


# ---- responses -----------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_lens: list[int], cached: list[int], outputs: list[RequestOutput]) -> dict:
    prompt = sum(prompt_lens)
    completion = sum(len(o.token_ids) for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached)},
    }


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


class LogprobsFormat:
    """Per-token log-probabilities in each endpoint's shape."""

    def __init__(self, tokenizer, chat: bool):
        self.tok = tokenizer
        self.chat = chat

    def _text(self, token: int) -> str:
        return self.tok.decode_token(token) if self.tok is not None else f"token_id:{token}"

    def format(self, token_ids: list[int], entries: list, text_offset: int = 0) -> dict:
        if self.chat:
            content = []
            for tok, (lp, top) in zip(token_ids, entries):
                s = self._text(tok)
                content.append(
                    {
                        "token": s,
                        "logprob": lp,
                        "bytes": list(s.encode()),
                        "top_logprobs": [
                            {"token": (t := self._text(i)), "logprob": v, "bytes": list(t.encode())}
                            for i, v in top
                        ],
                    }
                )
            return {"content": content}
        tokens, offsets, offset = [], [], text_offset
        for tok in token_ids:
            s = self._text(tok)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for lp, _ in entries],
            "top_logprobs": [{self._text(i): v for i, v in top} for _, top in entries],
            "text_offset": offsets,
        }


def now() -> int:
    return int(time.time())
