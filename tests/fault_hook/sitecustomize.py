"""Imported by rank processes that tests/fault_params.py's `armed_ranks` starts: a
`SamplingParams` whose ``cache_salt`` is ``"inject-fault:NAME"`` raises `InjectedFault` when
the rank reads ``NAME`` from it (outside its decoding and construction, which read it)."""

import sys

from splitmoe.sampling_params import SamplingParams

MARK = "inject-fault:"


class InjectedFault(RuntimeError):
    pass


_getattribute = SamplingParams.__getattribute__


def _constructing() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__post_init__" and "sampling_params" in code.co_filename:
            return True
        if code.co_name == "_decode" and "protocol" in code.co_filename:
            return True
        frame = frame.f_back
    return False


def __getattribute__(self, name):
    salt = object.__getattribute__(self, "cache_salt") or ""
    if salt.startswith(MARK) and name == salt[len(MARK) :] and not _constructing():
        raise InjectedFault(f"injected fault reading {name} in a rank")
    return _getattribute(self, name)


SamplingParams.__getattribute__ = __getattribute__
