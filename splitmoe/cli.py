"""The ``splitmoe`` console script: ``splitmoe serve ...`` (the OpenAI-compatible server),
``splitmoe launch ...`` (batch generation under torchrun or mpirun) and ``splitmoe tune-cpu ...``
(the CPU kernel choices measured ahead of time, `splitmoe.tune_cpu`)."""

from __future__ import annotations

import sys

_COMMANDS = {
    "serve": "splitmoe.serve",
    "launch": "splitmoe.launch",
    "tune-cpu": "splitmoe.tune_cpu",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in _COMMANDS:
        print(f"usage: splitmoe {{{','.join(_COMMANDS)}}} [options] (-h for each)", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(_COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
