"""Prefill-decode tests share one deployment secret (`splitmoe.kv_transfer.auth`): set in the
environment that the tests' instances, routers and rank processes inherit."""

from __future__ import annotations

import os

KV_SECRET = "pd-tests-secret-0123456789abcdef"
os.environ["SPLITMOE_KV_SECRET"] = KV_SECRET
