"""`SamplingParams` that raise inside a rank process, to test fault isolation.

A rank unpickles the params it serves; these remember the process that built them and raise
when a rank (another process) reads ``fault_on``, so the front end's checks pass and the fault
strikes only where the engine handles the request."""

from __future__ import annotations

import os
from dataclasses import dataclass

from splitmoe import SamplingParams


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class FaultyParams(SamplingParams):
    """Raises `InjectedFault` when a process other than its maker reads ``fault_on``
    (a `SamplingParams` attribute: ``"top_p"`` strikes in the sampler, ``"logprobs"`` in the
    logprobs, ``"seed"`` when the rank makes its generator)."""

    fault_on: str = "top_p"

    def __post_init__(self) -> None:
        object.__setattr__(self, "made_in", os.getpid())
        super().__post_init__()

    def __getattribute__(self, name: str):
        if name == object.__getattribute__(self, "fault_on") and os.getpid() != (
            object.__getattribute__(self, "made_in")
        ):
            raise InjectedFault(f"injected fault reading {name} in pid {os.getpid()}")
        return object.__getattribute__(self, name)
