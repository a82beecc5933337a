"""Every transport by the name `ParallelConfig.transport` gives it."""

from __future__ import annotations

from splitmoe.comm.flat import FlatTransport
from splitmoe.comm.transport import Transport
from splitmoe.comm.two_phase import AutoTransport, TwoPhaseTransport
from splitmoe.config import TRANSPORT_NAMES

TRANSPORTS: dict[str, type[Transport]] = {
    cls.name: cls for cls in (FlatTransport, TwoPhaseTransport, AutoTransport)
}
# (the config checks names against its own list, which must name exactly these)
assert tuple(TRANSPORTS) == TRANSPORT_NAMES, (tuple(TRANSPORTS), TRANSPORT_NAMES)
