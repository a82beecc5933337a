"""`SamplingParams` that raise inside a rank process, to test fault isolation.

Only declared data crosses to a rank (`splitmoe.engine.protocol`), so the fault travels as
data: `FaultyParams` are plain `SamplingParams` whose ``cache_salt`` names the attribute to
fail on. Rank processes started inside `armed_ranks` import ``tests/fault_hook/
sitecustomize.py``, which makes such params raise `InjectedFault` when a rank reads that
attribute (once they are built), so the front end's checks pass and the fault strikes only
where the engine handles the request."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from splitmoe import SamplingParams

MARK = "inject-fault:"
HOOK = Path(__file__).resolve().parent / "fault_hook"


def FaultyParams(fault_on: str = "top_p", **kw) -> SamplingParams:  # noqa: N802 (a maker)
    """Raise `InjectedFault` in a rank when it reads ``fault_on`` (a `SamplingParams`
    attribute: ``"top_p"`` strikes in the sampler, ``"logprobs"`` in the logprobs, ``"seed"``
    when the rank makes its generator, ``"ignore_eos"`` at admission)."""
    return SamplingParams(cache_salt=MARK + fault_on, **kw)


@contextlib.contextmanager
def armed_ranks():
    """Rank processes started meanwhile honour `FaultyParams`."""
    with contextlib.ExitStack() as stack:
        from pytest import MonkeyPatch

        mp = stack.enter_context(MonkeyPatch.context())
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HOOK), os.environ.get("PYTHONPATH", "")]))
        yield
