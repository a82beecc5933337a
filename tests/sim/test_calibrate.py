"""Fitting the CPU profile's step-level constants from the study's calibration runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitmoe.sim.calibrate import (
    CALIBRATION_PROMPT,
    CALIBRATION_RUNS,
    CALIBRATION_TOKENS,
    fit_runs,
)
from splitmoe.sim.hardware import HardwareProfile, Overheads
from splitmoe.sim.model import ModelShape
from splitmoe.sim.simulator import Deployment, Simulator

SHAPE = ModelShape(
    name="tiny", hidden=64, num_layers=4, num_moe_layers=4, vocab=256, num_experts=16, top_k=4,
    moe_intermediate=32, num_heads=4, num_kv_heads=2, head_dim=16,
)  # fmt: skip
COMPONENTS = Overheads(attn_layer_s=120e-6, seq_layer_s=3e-6, prefill_seq_layer_s=20e-6,
                       moe_layer_s=110e-6, expert_s=5e-6)  # fmt: skip


def _cpu(oh: Overheads, **kw) -> HardwareProfile:
    return HardwareProfile(
        name="cpu", peak_flops=1e11, mem_bytes_per_s=4e10, memory_bytes=1e10, gpus_per_node=64,
        weight_bytes=4, cores=2.0, overheads=oh, **kw,
    )  # fmt: skip


def _step(hw: HardwareProfile, a: int, e: int, b: int, m: int) -> float:
    dep = Deployment(a, e, micro_batches=m)
    run = Simulator(SHAPE, hw).run(dep, b, CALIBRATION_PROMPT, CALIBRATION_TOKENS, 2048)
    return run.tbt


def test_fit_recovers_the_step_constants_of_a_known_machine():
    truth = _cpu(
        replace(COMPONENTS, step_s=300e-6, proc_step_s=120e-6, proc_seq_step_s=12e-6,
                collective_s=(0.0, 30e-6), empty_micro_batch_s=90e-6, wake_s=70e-6,
                shared_step_s=250e-6),
        oversubscribed=1.9,
    )  # fmt: skip
    runs = {key: _step(truth, *key) for key in CALIBRATION_RUNS}
    fitted = fit_runs(SHAPE, _cpu(COMPONENTS), runs)
    for key, t in runs.items():  # every calibration run reproduced
        assert _step(fitted, *key) == pytest.approx(t, rel=0.02), key
    # the constants of ranks sharing cores are told apart: a wake-up (what a second micro-batch
    # adds), the step boundary per rank, the slow-down of per-token work
    oh = fitted.overheads
    assert oh.collective(2) == pytest.approx(30e-6, rel=0.05)
    assert oh.wake_s == pytest.approx(70e-6, rel=0.05)
    assert oh.shared_step_s == pytest.approx(250e-6, rel=0.05)
    assert fitted.oversubscribed == pytest.approx(1.9, rel=0.05)
    # and the configurations it was not fitted on
    for key in ((2, 1, 1, 1), (2, 1, 16, 2), (2, 2, 1, 1), (2, 2, 16, 2), (1, 1, 16, 2)):
        assert _step(fitted, *key) == pytest.approx(_step(truth, *key), rel=0.05), key
