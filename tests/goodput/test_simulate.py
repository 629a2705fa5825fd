"""The model against what is known in closed form: Young's and Daly's intervals, a job that
never fails, and the first-order expected waste of periodic checkpoints under Poisson failures."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from engine.goodput.simulate import JobModel, best_interval, simulate, young_daly_interval


def test_dalys_interval_is_youngs_corrected() -> None:
    # c = 10 s, M = 10,000 s: sqrt(2 c M) = 447.214; (c / 2M) = 0.0005, its root 0.022361;
    # Daly: 447.214 * (1 + 0.022361 / 3 + 0.0005 / 9) - 10 = 440.572.
    assert young_daly_interval(10.0, 10_000.0) == pytest.approx(440.572, abs=1e-3)
    assert young_daly_interval(30.0, 10.0) == 10.0  # a checkpoint longer than 2 M: save once per MTBF


def test_a_job_that_never_fails_loses_only_its_saves_and_first_start() -> None:
    model = JobModel(gpus=1, mtbf_gpu_hours=1e12, checkpoint_s=1.0, restart_s=10.0)
    outcome = simulate(model, interval_s=9.0, horizon_s=1010.0, trials=3)
    assert outcome.buckets["startup"] == pytest.approx(10.0)
    assert outcome.buckets["productive"] == pytest.approx(900.0)  # 100 cycles of 9 s + 1 s
    assert outcome.buckets["checkpoint_stall"] == pytest.approx(100.0)
    assert outcome.failures == 0


def test_the_waste_matches_the_first_order_formula_when_failures_are_rare() -> None:
    # Expected waste per unit time, to first order: c / tau + (tau + c) / (2 M) + R / M.
    c, restart, mtbf, tau = 5.0, 30.0, 20_000.0, 400.0
    model = JobModel(gpus=10, mtbf_gpu_hours=mtbf * 10 / 3600, checkpoint_s=c, restart_s=restart)
    outcome = simulate(model, interval_s=tau, horizon_s=2e6, trials=40, seed=3)
    waste = c / tau + (tau + c) / (2 * mtbf) + restart / mtbf
    assert 1 - outcome.goodput == pytest.approx(waste, abs=0.004)


def test_the_best_interval_is_near_young_daly() -> None:
    model = JobModel(gpus=1000, mtbf_gpu_hours=5000.0, checkpoint_s=6.3, restart_s=60.0)
    best = best_interval(model, horizon_s=7 * 86400, trials=30)
    daly = young_daly_interval(6.3, model.job_mtbf_s)
    assert daly / 2 < best.interval_s < daly * 2
    fixed = simulate(model, 3 * 3600.0, 7 * 86400, trials=30)
    assert best.goodput > fixed.goodput + 0.05


def test_the_model_command_imports_no_torch_and_runs_in_seconds() -> None:
    code = ("import sys, time; from engine.cli.main import main; began = time.monotonic(); "
            "status = main(['goodput', '--simulate', '--gpus', '10000', '--profile', 'async-dcp-7b', '--restart-s', '120']); "
            "print('torch' in sys.modules, round(time.monotonic() - began, 1)); sys.exit(status)")
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr
    torch_imported, seconds = process.stdout.splitlines()[-1].split()
    assert torch_imported == "False"
    assert "Young/Daly" in process.stdout and "fixed 10.0 min" in process.stdout
    assert float(seconds) < 30  # "seconds" on an idle machine; generous under the CI's load
    assert math.isfinite(float(seconds))
