"""The PD soak (scripts/soak_pd.py), bounded: random requests through the router while the
prefill instance is SIGSTOPped and continued and a decode attention rank is killed; every
request answered once with all its tokens, the decode instance recovered, every block free."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("mooncake.engine")

from server.server_proc import REPO  # noqa: E402


def test_pd_soak_with_a_stopped_prefill_and_a_killed_decode_rank(tmp_path):
    cmd = [sys.executable, str(REPO / "scripts" / "soak_pd.py"), "--requests", "60"]
    cmd += ["--concurrency", "8", "--logs", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "soak_pd: passed" in done.stdout, out[-3000:]
    assert "recoveries 1" in done.stdout
