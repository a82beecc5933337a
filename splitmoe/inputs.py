"""Checks on user input at the front door, before any rank sees it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from splitmoe.config import EngineConfig
from splitmoe.kv_transfer import check_remote_agents
from splitmoe.sampling_params import SamplingParams
from splitmoe.tokenizer import Tokenizer

Prompt = str | Sequence[int]


def normalize_prompts(prompts, tokenizer: Tokenizer | None) -> list[list[int]]:
    """A string, a list of strings, or a list of token-id lists -> token-id lists."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise TypeError(
            f"prompts must be a string, a list of strings or a list of token-id lists; got "
            f"{type(prompts).__name__}"
        )
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(
                    f"prompt {i} is text but the checkpoint has no tokenizer.json; pass token ids"
                )
            if not p:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            ids = tokenizer.encode(p)
        elif isinstance(p, Sequence) and not isinstance(p, (bytes, bytearray)):
            ids = list(p)
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)]
            if bad:
                raise TypeError(f"prompt {i} has non-integer token ids, e.g. {bad[0]!r}")
        else:
            raise TypeError(
                f"prompt {i} is a {type(p).__name__}; use a string or a list of token ids"
            )
        out.append(ids)
    return out


def check_request(i: int, ids: list[int], params: SamplingParams, cfg: EngineConfig) -> None:
    """Raises a clear error for a prompt/params pair no rank could serve."""
    vocab = cfg.model.vocab_size
    if not ids:
        raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(
            f"prompt {i} has token id(s) {bad[:5]} outside the vocabulary [0, {vocab})"
        )
    limit = cfg.max_model_len
    if len(ids) >= limit:
        raise ValueError(
            f"prompt {i} has {len(ids)} tokens, but max_model_len is {limit}: a prompt may have "
            f"at most {limit - 1} tokens"
        )
    params.check_vocab(vocab)
    kv = params.kv_transfer_params
    if kv is not None and kv.do_remote_prefill:
        check_remote_agents(kv.remote_agents, cfg.kv_transfer.kv_trusted_agents)
    if params.json_schema is not None:
        from splitmoe.attention_nodes.grammar import check_json_schema  # (xgrammar: when used)

        if not (Path(cfg.model.path) / "tokenizer.json").is_file():
            raise ValueError(
                "json_schema (structured output) needs the checkpoint's tokenizer.json"
            )
        try:
            check_json_schema(params.json_schema)
        except ValueError as e:
            raise ValueError(f"json_schema: {e}") from None
    blocks = cfg.cache.resolve_num_blocks(
        cfg.model,
        cfg.torch_dtype,
        cfg.scheduler.max_num_seqs,
        cfg.max_model_len,
        cfg.scheduler.max_num_batched_tokens,
    )
    need = min(len(ids) + params.max_tokens, limit) - 1
    if need > blocks * cfg.cache.block_size:
        raise ValueError(
            f"prompt {i} needs {need} KV slots (prompt {len(ids)} + max_tokens "
            f"{params.max_tokens}), more than the whole KV pool of {blocks} blocks x "
            f"{cfg.cache.block_size}; raise num_kv_blocks or lower max_tokens"
        )


def broadcast_params(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one or one each")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
    return params
