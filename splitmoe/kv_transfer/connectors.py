"""The KV connectors by name (`kv_connector`), each built over a rank's KV cache."""

from __future__ import annotations

from splitmoe.kv_transfer import KVConnector, pool_layouts
from splitmoe.kv_transfer.auth import require_secret

CONNECTORS = ("mooncake",)


def check_available(name: str) -> None:
    """Raises an ImportError that says what to install when connector ``name`` cannot load
    here (checked before any rank starts)."""
    if name == "mooncake":
        try:
            import mooncake.engine  # noqa: F401
        except ImportError as e:
            lib = "libibverbs" in str(e)
            need = (
                "the system library libibverbs1 (apt-get install libibverbs1), which Mooncake "
                "loads even over TCP"
                if lib
                else "the 'pd' extra: pip install 'splitmoe[pd]' (mooncake-transfer-engine-"
                "non-cuda), and the system library libibverbs1 (apt-get install libibverbs1)"
            )
            raise ImportError(
                f"kv_connector='mooncake' needs Mooncake's transfer engine, which does not load "
                f"here ({e}); install {need}"
            ) from None


def make_connector(kv, kv_cache) -> KVConnector:
    """The connector of ``kv`` (a `KVTransferConfig`) over this rank's ``kv_cache``, its pools
    registered and its agent signing with the deployment's secret."""
    if kv.kv_connector == "mooncake":
        from splitmoe.kv_transfer.mooncake import MooncakeConnector

        secret = require_secret(kv.kv_secret_file, "kv_connector='mooncake'")
        return MooncakeConnector(
            pool_layouts(kv_cache),
            kv.kv_host,
            kv.kv_transfer_timeout,
            secret,
            kv.kv_max_parked_blocks,
        )
    raise ValueError(f"kv_connector={kv.kv_connector!r}: the connectors are: mooncake")
