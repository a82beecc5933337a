"""Measures this machine's hardware profile for the cluster simulator.

    python scripts/calibrate_cpu.py --out splitmoe/sim/profiles/cpu.json

In-process: 1-thread GEMM FLOP/s and copy bandwidth, and the runtime's own attention layers and
experts timed on the model (host overhead per layer, per sequence, per activated expert). Then
the eleven short `LLM` runs of `splitmoe.sim.calibrate.CALIBRATION_RUNS` (1 and 2 colocated
ranks at 1 and 16 sequences, 1+1 at 1 and 16, 1+2 at 1 and 16, one and two micro-batches at 1
sequence, and 2+1 at 2) fit the step's fixed cost, the driver's cost of a multi-process
instance, the wait for a second attention rank with work, one collective call, a sequence's
trips through the expert ranks, an empty colocated micro-batch's layer loop, and, where rank
processes outnumber the cores, the wake-up of a sleeping rank, the step boundary's cost per
rank and per attention rank after the first, and the slow-down of per-token work. About a
minute on 2 cores. Timings on a shared machine drift: the scaling study (``--validate``,
``--held-out``) refits the run-based constants from its own runs, in the same passes as the
runs it checks.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from splitmoe.models.default_model import default_model_path
from splitmoe.sim.calibrate import calibrate  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the built-in model)")
    ap.add_argument("--out", default="out/cpu_profile.json")
    ap.add_argument("--max-world", type=int, default=4, help="largest calibration run (ranks)")
    args = ap.parse_args(argv)
    args.model = args.model or default_model_path()
    hw = calibrate(args.model, args.max_world)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    hw.to_file(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
