"""From a checked request body to its answer: the prompts' tokens, every sequence checked, the
queue's bound, the engine job and its outputs (a prefill instance's too, `server.kv`)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from splitmoe.attention_nodes.grammar import JSON_OBJECT_SCHEMA
from splitmoe.inputs import check_request
from splitmoe.outputs import RequestOutput
from splitmoe.server.engine import Job
from splitmoe.server.kv import handoff, parked_full, prefill_params
from splitmoe.server.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    Sampling,
    param_of,
)
from splitmoe.server.reply import Reply, ToolCalls
from splitmoe.server.schema_check import SchemaChecker
from splitmoe.server.state import HTTPError, ServerState, as_http

logger = logging.getLogger("splitmoe")

DEFAULT_MAX_TOKENS = 16  # (OpenAI's completions default)

_DISCONNECT_CHECK_S = 0.5  # how often a non-streaming request checks that its client is there

_QUEUE_RETRY_AFTER_S = 1  # Retry-After of a 503 for a full queue (a step frees sequences)


def check_model(model: str | None, state: ServerState) -> None:
    if model is not None and model not in (state.served_model_name, state.model_alias):
        raise HTTPError(
            404,
            f"the model {model!r} does not exist; this server serves "
            f"{state.served_model_name!r} (GET /v1/models)",
            "invalid_request_error",
            "model",
        )


async def check_kv(request: Request, body, state: ServerState) -> None:
    """``kv_transfer_params`` come from the router alone (a 403 for anyone else)."""
    if body.kv_transfer_params is not None:
        if not state.kv.allows(request.headers, await request.body()):
            raise HTTPError(403, state.kv.refusal(), "permission_error", "kv_transfer_params")


async def json_schema(
    body: CompletionRequest | ChatCompletionRequest, schemas: SchemaChecker
) -> str | None:
    """The grammar a ``response_format`` asks for, checked (a 400 for a schema it cannot be, or
    one too slow to convert; a 503 when the checks are busy)."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JSON_OBJECT_SCHEMA
    return await schemas.check(fmt.json_schema.schema_)


async def start_quietly(schemas: SchemaChecker) -> None:
    try:
        await schemas.start()
    except Exception as e:  # (the first structured request will say what is wrong)
        logger.warning("the JSON schema checker did not start: %s", e)


def default_chat_max(state: ServerState) -> int:
    # (what is left of the context: a request stops at max_model_len whatever its max_tokens)
    return state.config.max_model_len


def prompt_tokens(prompt, state: ServerState) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if state.tokenizer is None:
        raise BadRequest(
            "text prompts need the model's tokenizer.json; send token ids instead", "prompt"
        )
    ids = state.tokenizer.encode(prompt)
    if not ids:
        raise BadRequest("the prompt encodes to no tokens", "prompt")
    return ids


def decode_text(ids: list[int], state: ServerState) -> str:
    return state.tokenizer.decode(ids) if state.tokenizer is not None else ""


async def generate(
    request: Request,
    state: ServerState,
    prompts: list[list[int]],
    s: Sampling,
    chat: bool,
    echo: list[str] | None = None,
    tools: ToolCalls | None = None,
):
    kv = s.params[0].kv_transfer_params
    if kv is not None and kv.do_remote_decode:  # (a prefill instance: see `server.kv`)
        return await _prefill(request, state, prompts, s, chat)
    # (linear in the prompts' tokens, and a schema's first check converts it: off the loop)
    seqs, params = await asyncio.to_thread(_sequences, state, prompts, s, chat)
    _check_queue(state, len(seqs))
    job = Job(seqs, params, s.stream, asyncio.get_running_loop())
    state.engine.submit(job)
    state.inflight += len(seqs)
    rid = request.state.request_id
    reply = Reply(state, prompts, s, chat, rid, echo, tools)
    if s.stream:
        return StreamingResponse(reply.stream(request, job), media_type="text/event-stream")
    try:
        outputs = await _collect(request, state, job)
    finally:
        state.inflight -= len(seqs)
    if outputs is None:  # (the client left)
        return Response(status_code=499)
    # (tool-call parsing and logprobs formatting are linear in the output, which can be long:
    # off the event loop)
    return await asyncio.to_thread(reply.whole, outputs)


def _sequences(
    state: ServerState, prompts: list[list[int]], s: Sampling, chat: bool
) -> tuple[list[list[int]], list]:
    """Each prompt ``n`` times with its params, every pair checked (`check_request`)."""
    seqs, params = [], []
    for i, p in enumerate(prompts):
        for sp in s.params:
            try:
                if chat and not s.max_tokens_given:  # (the rest of the context, or KV pool)
                    sp = replace(sp, max_tokens=max(1, state.context_for_chat - len(p)))
                check_request(i, p, sp, state.config)
            except ValueError as e:
                raise BadRequest(str(e), param_of(str(e))) from None
            seqs.append(p)
            params.append(sp)
    return seqs, params


def _check_queue(state: ServerState, sequences: int) -> None:
    if state.max_queued_requests is not None:
        queued = max(0, state.inflight + sequences - state.capacity)
        if queued > state.max_queued_requests:
            raise HTTPError(
                503,
                f"the queue is full ({state.max_queued_requests} sequences may wait, "
                "--max-queued-requests); retry later",
                "service_unavailable",
                headers={"Retry-After": str(_QUEUE_RETRY_AFTER_S)},
            )


async def _prefill(
    request: Request, state: ServerState, prompts: list[list[int]], s: Sampling, chat: bool
):
    """A prefill instance's answer (`splitmoe.server.kv`): the request was checked as the
    client sent it; each prompt is computed once, its blocks parked for its ``n`` readers."""
    vocab = state.config.model.vocab_size
    one = prefill_params(s.params)
    try:
        for sp in s.params:
            sp.check_vocab(vocab)
        for i, p in enumerate(prompts):
            check_request(i, p, one, state.config)
    except ValueError as e:
        raise BadRequest(str(e), param_of(str(e))) from None
    if parked_full(state.engine.latest_stats()):
        raise HTTPError(
            503,
            "this prefill instance parks as much KV as it may (--kv-max-parked-blocks); the "
            "decode instance computes the prompt",
            "service_unavailable",
        )
    _check_queue(state, len(prompts))
    job = Job(prompts, [one] * len(prompts), False, asyncio.get_running_loop())
    state.engine.submit(job)
    state.inflight += len(prompts)
    try:
        outputs = await _collect(request, state, job)
    finally:
        state.inflight -= len(prompts)
    if outputs is None:  # (the client left)
        return Response(status_code=499)
    single = replace(
        s, params=[one], n=1, stream=False, include_usage=False, echo=False, logprobs=None
    )
    reply = Reply(state, prompts, single, chat, request.state.request_id, None, None)
    body = reply.whole(outputs)
    body["kv_transfer_params"] = handoff(one.kv_transfer_params, state.engine.latest_stats())
    return body


async def _collect(request: Request, state: ServerState, job: Job) -> list[RequestOutput] | None:
    outputs: list[RequestOutput | None] = [None] * len(job.prompts)
    left = len(outputs)
    try:
        while left:
            try:
                items = await asyncio.wait_for(job.queue.get(), _DISCONNECT_CHECK_S)
            except TimeoutError:
                if await request.is_disconnected():
                    return None
                continue
            if isinstance(items, Exception):
                raise as_http(items, request.state.request_id)
            for d in items:
                if d.output is not None:
                    outputs[d.index] = d.output
                    left -= 1
        job.done = True
        return outputs
    finally:
        state.engine.abort(job)  # (nothing when it finished)
