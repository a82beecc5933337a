"""The prefill-decode router: the OpenAI API in front of prefill and decode instances.

``python -m splitmoe.router --prefill URL [URL ...] --decode URL [URL ...] --port P``

Each completion is checked at the door as the instances check it (the same pydantic schema,
the same body limit: a 400 or 413 before any instance works), then sent first to a prefill
instance as the client wrote it plus ``kv_transfer_params={"do_remote_decode": true, ...}``:
the prefill instance checks the whole request again (a request the decode side would refuse is
refused before its prompt is computed), computes each prompt once and parks its KV blocks for
the ``n`` readers, and answers with where they are (its KV agents, read at answer time, so a
restarted instance gives its new ones). Then the request goes to a decode instance with
``kv_transfer_params={"do_remote_prefill": true, "remote_agents": [...]}``: its ranks pull the
blocks and generate; the decode instance's answer (streamed or whole) is the client's, with
``usage.prompt_tokens_details.cached_tokens`` taken from the prefill instance. Every request
that carries ``kv_transfer_params`` is signed with the deployment's secret
(`splitmoe.kv_transfer.auth`): instances refuse them from anyone else.

The prefill instance is chosen by cached prefix (the prompts each instance was sent lately,
hashed in 64-character or 16-token chunks, off the event loop) and then by load (requests in
flight); the decode instance by load. Failures, each bounded in time:

* a prefill instance that cannot be reached, answers 5xx or nothing within
  ``--prefill-timeout`` is skipped for the next one, and one that failed is left out for a
  few seconds (`DOWN_S`); with none left the decode instance computes the prompt itself (it
  also does when its pull fails); an instance over its parked-KV cap (503) is skipped too;
* the decode instance refuses the request or fails, or the client disconnects (streaming or
  not): the decode request is aborted (its connection closed) and the prefill instance's
  parked blocks for it are released at once through its KV agents;
* a decode instance that cannot be reached is skipped; one that fails mid-stream, sends a
  malformed event or nothing for ``--decode-timeout`` ends the stream with an error event and
  ``data: [DONE]``;
* ``GET /health`` answers within ``--health-timeout`` and names the instances that did not.

``GET /metrics`` gives the client's TTFT as the router sees it, split: the prefill stage
(``splitmoe:pd_prefill_seconds``, retries included) and the decode instance's part up to the
first streamed token (``splitmoe:pd_decode_first_token_seconds``), which its own ``/metrics``
splits again into the KV pull and the first step (`splitmoe.server.metrics`).
"""

from __future__ import annotations

from splitmoe.router.app import build_app, main
from splitmoe.router.core import Router, Timeouts

__all__ = ["Router", "Timeouts", "build_app", "main"]
