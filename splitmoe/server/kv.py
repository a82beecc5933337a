"""The server's part in prefill-decode disaggregation (docs/pd.md): who may steer a transfer,
what a prefill instance computes, and what it answers the router.

* **Trust.** ``kv_transfer_params`` in a request body, and ``/internal/*``, are the router's:
  an instance accepts them only with a valid `auth.HEADER` tag over the body (or the path),
  made with the deployment's secret (`splitmoe.kv_transfer.auth`); anyone else gets a 403
  before any work. An instance without a KV connector has no secret and refuses them all.
* **Prefill.** A request with ``do_remote_decode`` is the client's request as sent: it is
  checked whole (every field, as the decode instance will check it), so a request the decode
  side would refuse is refused before its prompt is computed; then its prompts are computed
  once each (one token, one sequence per prompt, their blocks parked for the ``n`` readers of
  each) and the answer is whole, with ``kv_transfer_params`` telling the router where the
  blocks are (this instance's agents, read at answer time: a restarted instance gives its
  new ones).
* **Bounds.** Over the parked-block cap of every attention rank, a prefill request is a 503
  (the router lets the decode instance compute the prompt).
"""

from __future__ import annotations

import uuid
from dataclasses import replace

from splitmoe.config import EngineConfig
from splitmoe.kv_transfer import KVTransferParams
from splitmoe.kv_transfer.auth import HEADER, load_secret, verify
from splitmoe.sampling_params import SamplingParams


class KVGate:
    """One instance's view of its part in transfers: its secret and its identity."""

    def __init__(self, config: EngineConfig):
        kv = config.kv_transfer
        self.role = kv.kv_role
        self.connector = kv.kv_connector
        self.secret = load_secret(kv.kv_secret_file) if kv.kv_connector else None
        # changes with every start: the router tells a restarted instance from the one it knew
        self.instance_id = uuid.uuid4().hex

    def allows(self, headers, payload: bytes) -> bool:
        """Whether a request bearing ``headers`` signed ``payload`` with the secret."""
        return verify(self.secret, headers.get(HEADER), payload)

    def refusal(self) -> str:
        if self.secret is None:
            return (
                "kv_transfer_params and /internal/* are for the prefill-decode router; this "
                "instance has no KV connector"
            )
        return (
            "kv_transfer_params and /internal/* are for the prefill-decode router: the request "
            f"lacks a valid {HEADER} signed with the deployment's KV secret"
        )


def prefill_params(params: list[SamplingParams]) -> SamplingParams:
    """The one sequence a prefill instance computes for a prompt whose ``n`` copies (``params``,
    checked as the client sent them) decode elsewhere: one greedy token, nothing that only
    shapes the output (stop strings, grammar, logprobs, penalties), its blocks parked for
    ``n`` readers."""
    first = params[0]
    kv = replace(first.kv_transfer_params, num_readers=len(params))
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        ignore_eos=True,
        cache_salt=first.cache_salt,
        kv_transfer_params=kv,
    )


def parked_full(stats: list[dict]) -> bool:
    """Whether every attention rank parks as many blocks as it may (from their published
    counters)."""
    ranks = [s for s in stats if "kv_max_parked_blocks" in s]
    return bool(ranks) and all(s["kv_parked_blocks"] >= s["kv_max_parked_blocks"] for s in ranks)


def handoff(kv: KVTransferParams, stats: list[dict]) -> dict:
    """What a prefill answer tells the router to give the decode instance."""
    agents = [s["kv_agent"] for s in stats if s.get("kv_agent")]
    return {"transfer_id": kv.transfer_id, "do_remote_prefill": True, "remote_agents": agents}


def kv_status(gate: KVGate, stats: list[dict]) -> dict:
    """``GET /internal/kv``: this instance's role and identity, its attention ranks' KV agents
    and block counts, from their latest published counters."""
    ranks = [s for s in stats if "kv_blocks_used" in s]
    keys = (
        "rank",
        "kv_agent",
        "kv_blocks_used",
        "kv_window_blocks_used",
        "kv_parked",
        "kv_parked_blocks",
        "kv_max_parked_blocks",
        "kv_transfers",
        "kv_transfer_failures",
        "kv_transfer_bytes",
    )
    return {
        "kv_role": gate.role,
        "kv_connector": gate.connector,
        "instance_id": gate.instance_id,
        "agents": [s["kv_agent"] for s in ranks if s.get("kv_agent")],
        "ranks": [{k: s[k] for k in keys if k in s} for s in ranks],
    }
