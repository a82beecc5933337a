"""The KV connectors by name (`kv_connector`), each built over a rank's KV cache."""

from __future__ import annotations

from splitmoe.kv_transfer import KVConnector, pool_layouts


def make_connector(name: str, kv_cache, host: str, timeout_s: float) -> KVConnector:
    """The connector ``name`` over this rank's ``kv_cache`` (its pools registered)."""
    if name == "mooncake":
        from splitmoe.kv_transfer.mooncake import MooncakeConnector

        return MooncakeConnector(pool_layouts(kv_cache), host, timeout_s)
    raise ValueError(f"kv_connector={name!r}: the connectors are: mooncake")
