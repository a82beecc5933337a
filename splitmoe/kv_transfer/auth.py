"""The shared secret of a prefill-decode deployment: who may steer a KV transfer.

The router and every instance with a KV connector share one secret (``SPLITMOE_KV_SECRET`` in
the environment, or ``--kv-secret-file PATH``; the file wins where both are set). It never
crosses the network: what travels is an HMAC-SHA256 tag over the message and a timestamp, so
a peer that sees the traffic learns nothing it could sign another message with, and a tag is
good for `WINDOW_S` only.

* HTTP (router -> instance): `HEADER` carries ``sign(secret, body)`` on every request with
  ``kv_transfer_params`` and on ``/internal/*``; an instance refuses such a request without a
  valid tag (403) before any work.
* The KV agents' side channel (instance <-> instance, `splitmoe.kv_transfer.agent`): every
  request line is signed the same way, and every reply is tagged over the request's tag and
  the reply, so a reader accepts only a fresh answer from a holder of the secret: a stale
  listener on a reused port, or a fake agent, fails that one transfer and nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import time
from pathlib import Path

SECRET_ENV = "SPLITMOE_KV_SECRET"
HEADER = "X-Splitmoe-Kv-Auth"
MIN_SECRET_CHARS = 16
# How far a tag's timestamp may be from the receiver's clock (hosts' clocks differ a little);
# a captured request replays for at most this long.
WINDOW_S = 300.0

HOW_TO = (
    f"set the same secret on the router and every instance: export {SECRET_ENV}=$(python -c "
    "'import secrets; print(secrets.token_hex(32))'), or write it to a file readable only by "
    "the service and pass --kv-secret-file PATH (LLM(kv_secret_file=PATH))"
)


def load_secret(secret_file: str | None = None) -> bytes | None:
    """The deployment's secret (``secret_file`` first, else ``SPLITMOE_KV_SECRET``), None when
    neither is set. A file that cannot be read, or a secret shorter than `MIN_SECRET_CHARS`, is
    a ValueError that says how to set one."""
    if secret_file:
        try:
            text = Path(secret_file).read_text().strip()
        except OSError as e:
            raise ValueError(
                f"kv_secret_file: cannot read the KV secret file ({e.strerror}); {HOW_TO}"
            ) from None
        source = "kv_secret_file"
    else:
        text = os.environ.get(SECRET_ENV, "").strip()
        source = SECRET_ENV
        if not text:
            return None
    if len(text) < MIN_SECRET_CHARS:
        raise ValueError(
            f"{source}: the KV secret has {len(text)} characters; it needs at least "
            f"{MIN_SECRET_CHARS}; {HOW_TO}"
        )
    return text.encode()


def require_secret(secret_file: str | None, who: str) -> bytes:
    """`load_secret`, or a ValueError naming ``who`` needs it and how to set it."""
    secret = load_secret(secret_file)
    if secret is None:
        raise ValueError(f"{who} needs the deployment's KV secret: {HOW_TO}")
    return secret


def _mac(secret: bytes, *parts: bytes) -> str:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))  # (lengths first: no two splits sign alike)
        h.update(p)
    return h.hexdigest()


def sign(secret: bytes, payload: bytes, now: float | None = None) -> str:
    """A tag ``"<unix time>.<hex HMAC>"`` over ``payload`` and the time."""
    ts = f"{time.time() if now is None else now:.3f}"
    return f"{ts}.{_mac(secret, ts.encode(), payload)}"


def verify(secret: bytes | None, tag: str | None, payload: bytes, now: float | None = None) -> bool:
    """Whether ``tag`` is `sign`'s over ``payload``, made within `WINDOW_S` of ``now``
    (compared in constant time). False without a secret: nothing is trusted then."""
    if secret is None or not tag or len(tag) > 128:
        return False
    ts, _, mac = tag.rpartition(".")
    try:
        when = float(ts)
    except ValueError:
        return False
    if not math.isfinite(when) or abs((time.time() if now is None else now) - when) > WINDOW_S:
        return False
    return hmac.compare_digest(mac, _mac(secret, ts.encode(), payload))


def reply_tag(secret: bytes, request_tag: str, payload: bytes) -> str:
    """The tag of an answer to the request tagged ``request_tag``: binds the answer to that
    request, so an old answer cannot be replayed to a new one."""
    return _mac(secret, b"reply", request_tag.encode(), payload)


def verify_reply(secret: bytes, request_tag: str, tag: str, payload: bytes) -> bool:
    return hmac.compare_digest(tag, reply_tag(secret, request_tag, payload))
