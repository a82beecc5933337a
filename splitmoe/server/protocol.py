"""OpenAI's request and response shapes for ``/v1/completions`` and ``/v1/chat/completions``.

Request bodies are pydantic models (strict: a string is not a number, a bool not an integer;
an unknown field is an error), so FastAPI publishes them in ``/openapi.json`` with every range
a client can rely on, and property-based fuzzers (schemathesis) build requests from them.
`sampling` turns a checked body into `SamplingParams`, which check the same ranges again for
the Python API. Every problem is a `BadRequest` that names the field; `validation_error`
words pydantic's errors the same way.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from splitmoe.attention_nodes.grammar import json_depth
from splitmoe.outputs import RequestOutput
from splitmoe.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20  # (OpenAI's limit for chat; 5 for completions, allowed up to this here)
MAX_N = 128  # completions per prompt
MAX_SEED = 2**64 - 1
# Levels of nesting in a request's free-form JSON (a tool's parameters, chat_template_kwargs,
# a tool call's arguments): deeper is a 400. Python's recursion limit (~1000) is what deeper
# values hit on their way through templates and json.dumps (a 500); real tool schemas nest a
# few levels (OpenAI's structured outputs allow 10 levels of objects).
MAX_JSON_DEPTH = 64


class BadRequest(ValueError):
    """A 400: ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_body(
    message: str, kind: str, code: int, param: str | None = None, request_id: str | None = None
) -> dict:
    """OpenAI's error shape (plus the request id that the server log files details under)."""
    err = {"message": message, "type": kind, "param": param, "code": code}
    if request_id is not None:
        err["request_id"] = request_id
    return {"error": err}


def _limit(default: float, doc: str):
    return field(default=default, metadata={"help": doc})


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, and how long it may take to send: over a limit is a 400
    (413 for the body, 408 for a body too slow) that names the limit, before any rank sees the
    request. Each field is a server flag (``--max-n``, ...; `add_args`)."""

    max_request_bytes: int = _limit(16 << 20, "largest request body; a larger one is a 413")
    max_prompts_per_request: int = _limit(256, "prompts one /v1/completions request may batch")
    max_n: int = _limit(MAX_N, f"completions per prompt ('n', 'best_of'; at most {MAX_N})")
    max_stop_strings: int = _limit(16, "stop strings per request")
    max_stop_string_chars: int = _limit(256, "characters per stop string")
    max_logit_bias: int = _limit(300, "entries in a request's 'logit_bias' (OpenAI's limit)")
    schema_check_timeout: float = _limit(
        5.0,
        "seconds a response_format JSON schema may take to turn into a grammar; a slower one "
        "is a 400",
    )
    request_read_timeout: float = _limit(
        60.0, "seconds a client has to send a request's body once its headers came; then a 408"
    )
    header_read_timeout: float = _limit(
        20.0,
        "seconds a connection has to send a request's headers (from its opening, or from the "
        "end of its last response); then it is closed",
    )

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if not getattr(self, name) >= 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_n > MAX_N:
            raise ValueError(f"--max-n must be <= {MAX_N}")

    @staticmethod
    def add_args(parser) -> None:
        """One ``--flag`` per field, with its default and help."""
        for f in fields(Limits):
            flag = "--" + f.name.replace("_", "-")
            kind = type(f.default)
            parser.add_argument(flag, type=kind, default=f.default, help=f.metadata["help"])

    @classmethod
    def from_args(cls, args) -> Limits:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


# ---- request bodies ------------------------------------------------------------------------------
_Strict = ConfigDict(strict=True, extra="forbid")


def _integral(v):
    """JSON Schema's integers include 2.0: taken as 2 (strict mode refuses other floats)."""
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2**63 else v


def _shallow(value):
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def _json_text(text: str) -> str:
    """A tool call's ``arguments``: empty, or JSON text nested at most `MAX_JSON_DEPTH` levels
    (the chat template reads it as an object; 100,000 levels were a RecursionError, a 500)."""
    if not text:
        return text
    try:
        value = json.loads(text)
    except RecursionError:  # (past the interpreter's limit: found in linear time)
        raise ValueError(f"nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # (JSONDecodeError, or an integer of more than 4300 digits)
        raise ValueError(f"is not JSON text ({e})") from None
    _shallow(value)
    return text


Int = Annotated[int, BeforeValidator(_integral)]
FreeJSON = Annotated[dict[str, Any], AfterValidator(_shallow)]  # (any JSON object, bounded)
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
TokenId = Annotated[Int, Field(ge=0)]
Text = Annotated[str, Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = _Strict
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _Strict
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self) -> ResponseFormat:
        schema = self.json_schema.schema_ if self.json_schema else None
        if self.type == "json_schema" and not schema:
            raise ValueError("type 'json_schema' needs json_schema.schema")
        return self


class _Sampling(BaseModel):
    """The fields both endpoints share (OpenAI's, then vLLM's extensions)."""

    model_config = _Strict
    model: str | None = None
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    n: Annotated[Int, Field(ge=1, le=MAX_N)] | None = None
    seed: Annotated[Int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: Text | list[Text] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None = None
    user: str | None = None  # (OpenAI's end-user id: accepted, not used)
    response_format: ResponseFormat | None = None
    # vLLM's extensions
    top_k: Annotated[Int, Field(ge=-1)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    min_tokens: Annotated[Int, Field(ge=0)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # prefill-decode disaggregation: set by `splitmoe.router` (checked by KVTransferParams)
    kv_transfer_params: dict | None = None


class CompletionRequest(_Sampling):
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = None
    best_of: Annotated[Int, Field(ge=1, le=MAX_N)] | None = None


class TextPart(BaseModel):
    model_config = _Strict
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _Strict
    name: str
    arguments: Annotated[str, AfterValidator(_json_text)]


class ToolCall(BaseModel):
    model_config = _Strict
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _Strict
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(BaseModel):
    model_config = _Strict
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: FreeJSON | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _Strict
    type: Literal["function"]
    function: FunctionDef


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extensions
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: FreeJSON | None = None


_WHAT = {  # fields whose type is a union: one message for all of pydantic's per-branch errors
    "prompt": "a non-empty string, a list of strings, a list of token ids (integers >= 0) or a "
    "list of lists of token ids",
    "stop": "a non-empty string or a list of them",
    "content": "a string, a list of text parts or null",
}
_NUMBER = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def validation_error(exc: ValidationError | list[dict]) -> BadRequest:
    """pydantic's (or FastAPI's) errors as one 400 that names the first field at fault."""
    errors = exc.errors() if isinstance(exc, ValidationError) else list(exc)
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return BadRequest(f"the request body is not valid JSON: {first.get('msg')}")
    loc = _path(first)
    if not loc:
        return BadRequest("the request body must be a JSON object")
    field, where = loc[0], ".".join(loc)
    if kind == "extra_forbidden":
        return BadRequest(f"unknown field '{where}'; docs/serving.md lists the fields", field)
    if kind == "missing":
        return BadRequest(f"'{where}' is required", field)
    union = [e for e in errors if _path(e)[:1] == [field]]
    what = _WHAT.get(field) or _WHAT.get(loc[-1])
    if len(union) > 1 and what:
        return BadRequest(f"'{where}' must be {what}", field)
    return BadRequest(f"'{where}' {_wording(first)}", field)


def _path(e: dict) -> list[str]:
    """An error's location without FastAPI's "body" and pydantic's union branch names
    (``list[int]``, ``str``)."""
    return [
        str(x)
        for x in e.get("loc", ())
        if x != "body" and (isinstance(x, int) or (x.isidentifier() and x not in _BRANCHES))
    ]


_BRANCHES = {"str", "int", "float", "bool", "dict", "list", "none"}


def _wording(e: dict) -> str:
    kind, ctx, got = e.get("type", ""), e.get("ctx") or {}, e.get("input")
    shown = repr(got)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    for key, op in _NUMBER.items():
        if key in ctx and kind.startswith(("greater", "less")):
            return f"must be {op} {ctx[key]}; got {shown}"
    words = {
        "int_type": "must be an integer",
        "float_type": "must be a number",
        "finite_number": "must be a finite number",
        "bool_type": "must be true or false",
        "string_type": "must be a string",
        "list_type": "must be a list",
        "dict_type": "must be an object",
        "model_type": "must be an object",
        "model_attributes_type": "must be an object",
        "literal_error": f"must be one of {ctx.get('expected')}",
        "too_short": f"must have at least {ctx.get('min_length')} item(s) or character(s)",
        "too_long": f"must have at most {ctx.get('max_length')} item(s) or character(s)",
        "string_too_short": f"must have at least {ctx.get('min_length')} character(s)",
        "string_too_long": f"must have at most {ctx.get('max_length')} character(s)",
        "value_error": str(e.get("msg", "")).removeprefix("Value error, "),
    }
    return f"{words.get(kind, e.get('msg', 'is invalid'))}; got {shown}"


# ---- checked body -> SamplingParams --------------------------------------------------------------
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
    echo: bool = False


_PARAM = re.compile(r"^(\w+)")


def param_of(message: str) -> str | None:
    """The request field a check's message is about: its first word where that is a sampling
    field (`SamplingParams` messages begin so), else ``prompt`` for the prompt checks."""
    m = _PARAM.match(message)
    if m and m.group(1) in SamplingParams.__dataclass_fields__:
        return m.group(1)
    return "prompt" if "prompt" in message else None


def sampling(
    req: CompletionRequest | ChatCompletionRequest,
    limits: Limits,
    default_max_tokens: int,
    json_schema: str | None = None,
) -> Sampling:
    """The request's `SamplingParams` (``json_schema``: the checked schema of its
    ``response_format``, if any), after the limits that are server flags."""
    chat = isinstance(req, ChatCompletionRequest)
    max_tokens = req.max_completion_tokens if chat else None
    max_tokens = max_tokens if max_tokens is not None else req.max_tokens
    given = max_tokens is not None
    n = req.n or 1
    if n > limits.max_n:
        raise BadRequest(f"'n' is {n}; at most {limits.max_n} is allowed (--max-n)", "n")
    stop = _stop_strings(req, limits)
    logprobs = _logprobs(req, n)
    bias = _logit_bias(req, limits)
    top_k = req.top_k if req.top_k not in (None, 0) else -1  # (0, as -1: no top-k)
    opts = dict(
        max_tokens=max_tokens if given else default_max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=top_k,
        top_p=1.0 if req.top_p is None else req.top_p,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        stop=tuple(stop),
        logprobs=logprobs,
    )
    optional = dict(
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=bias,
        min_tokens=req.min_tokens,
        cache_salt=req.cache_salt,
        json_schema=json_schema,
        kv_transfer_params=req.kv_transfer_params,
    )
    opts.update({k: v for k, v in optional.items() if v is not None})
    try:
        params = [
            SamplingParams(**opts, seed=None if req.seed is None else (req.seed + i) % 2**64)
            for i in range(n)
        ]
    except ValueError as e:
        raise BadRequest(str(e), param_of(str(e))) from None
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return Sampling(
        params,
        n,
        bool(req.stream),
        include_usage,
        logprobs,
        given,
        bool(req.return_token_ids),
        echo=bool(getattr(req, "echo", False)),
    )


def _stop_strings(req, limits: Limits) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    if len(stop) > limits.max_stop_strings:
        raise BadRequest(
            f"'stop' has {len(stop)} strings; at most {limits.max_stop_strings} are allowed "
            "(--max-stop-strings)",
            "stop",
        )
    for s in stop:
        if not s:
            raise BadRequest("'stop' strings must not be empty", "stop")
        if len(s) > limits.max_stop_string_chars:
            raise BadRequest(
                f"a 'stop' string has {len(s)} characters; at most "
                f"{limits.max_stop_string_chars} are allowed (--max-stop-string-chars)",
                "stop",
            )
    return stop


def _logprobs(req, n: int) -> int | None:
    """The top-k log-probabilities asked for (None: none), after the combinations refused."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    if req.best_of not in (None, 1, n):
        raise BadRequest("'best_of' other than 1 or n is not supported", "best_of")
    if req.echo and req.logprobs is not None:
        raise BadRequest(
            "'echo' with 'logprobs' would need the prompt's log-probabilities, which this "
            "server does not compute; drop one of them",
            "echo",
        )
    return req.logprobs


def _logit_bias(req, limits: Limits) -> dict[int, float] | None:
    if not req.logit_bias:
        return None
    if len(req.logit_bias) > limits.max_logit_bias:
        raise BadRequest(
            f"'logit_bias' has {len(req.logit_bias)} entries; at most "
            f"{limits.max_logit_bias} are allowed (--max-logit-bias)",
            "logit_bias",
        )
    bias = {}
    for key, value in req.logit_bias.items():
        # (ASCII digits only, and few: int() takes "²" for a digit and refuses more than
        # 4300 of them, both a ValueError that was a 500)
        if not (key.isascii() and key.isdigit() and len(key) <= 19):
            shown = key if len(key) <= 24 else key[:21] + "..."
            raise BadRequest(
                f"'logit_bias' keys must be token ids (decimal strings); got {shown!r}",
                "logit_bias",
            )
        bias[int(key)] = value
    return bias


def prompts_of(req: CompletionRequest, limits: Limits) -> list[str | list[int]]:
    """A completion's ``prompt`` as a list of prompts (strings or token-id lists)."""
    p = req.prompt
    if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
        p = [p]
    if not p:
        raise BadRequest(f"'prompt' must be {_WHAT['prompt']}", "prompt")
    if len(p) > limits.max_prompts_per_request:
        raise BadRequest(
            f"'prompt' has {len(p)} prompts; at most {limits.max_prompts_per_request} are "
            "allowed per request (--max-prompts-per-request)",
            "prompt",
        )
    for i, x in enumerate(p):
        if not x:
            raise BadRequest(f"prompt {i} is empty; every prompt needs text or tokens", "prompt")
    return list(p)


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """The messages as the chat template sees them (text parts joined; `ChatTemplate` drops
    what is None and reads tool calls' JSON arguments, as HF does)."""
    out = []
    for m in req.messages:
        d = m.model_dump()
        if isinstance(m.content, list):
            d["content"] = "".join(part.text for part in m.content)
        elif m.content is None and not m.tool_calls:  # (templates read every message's content)
            d["content"] = ""
        out.append(d)
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
