"""How a front end starts its rank processes: CPU ranks fork from one preloaded server, unless
what a process reads as it starts (its load variables) would differ from the server's."""

from __future__ import annotations

import os
from types import SimpleNamespace

from splitmoe.engine import procs

CPU, GPU = SimpleNamespace(device_type="cpu"), SimpleNamespace(device_type="cuda")


def method(cfg, omp=None) -> str:
    return procs.start_context(cfg, omp or {}).get_start_method()


def test_cpu_ranks_fork_only_where_a_fresh_start_would_load_the_same(monkeypatch):
    assert method(CPU) == "forkserver"
    assert method(CPU) == "forkserver"  # (the same server)
    # read after the start: the rank takes the front end's environment over (`rank_main`)
    monkeypatch.setenv("SPLITMOE_KV_SECRET", "x")
    assert method(CPU) == "forkserver"
    # read as the process starts: a fork of the server would not have them
    assert method(CPU, {"GOMP_SPINCOUNT": "1000"}) == "spawn"
    assert method(GPU) == "spawn"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/elsewhere", os.environ["PYTHONPATH"]]))
    assert method(CPU) == "spawn"
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert method(CPU) == "spawn"
    monkeypatch.undo()
    assert method(CPU) == "forkserver"
