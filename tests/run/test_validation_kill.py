"""SIGKILL of real processes inside validation, inside an epoch's aggregation and right after a
checkpoint that follows a validation: the finished run equals the uninterrupted one bit for bit
(weights, every row of metrics.jsonl, early-stopping state)."""

from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import forkserver
import pytest
import torch

from kill_helpers import WITH_A_WRITER_PROCESS_EXHAUSTIVE, killed_at_the_fault
from resume_helpers import assert_same_run
from validation_scenarios import best_policy, kept_best, train_validated
import engine

SCRIPT = str(pathlib.Path(__file__).parent.parent / "validation_scenarios.py")
TIMEOUT = 120

pytestmark = pytest.mark.slow


def start(run_dir, faults=None, *args, stderr=subprocess.DEVNULL):
    env = dict(os.environ)
    env.pop("SPLITLOOP_FAULTS", None)
    if faults:
        env["SPLITLOOP_FAULTS"] = faults
    return forkserver.popen([sys.executable, SCRIPT, run_dir, *args], env=env, stdout=subprocess.PIPE,
                            stderr=stderr, text=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_validated(run_dir, epochs=3, every_steps=5, callbacks=(engine.EarlyStopping("val_loss", patience=50),),
                    checkpoint=best_policy())
    return run_dir


def assert_same_best(reference, run_dir):
    expected, actual = kept_best(reference), kept_best(run_dir)
    assert len(expected) == 2 and [e[:2] for e in expected] == [a[:2] for a in actual]
    for (_, _, a), (_, _, b) in zip(expected, actual):
        assert all(torch.equal(a[key], b[key]) for key in a)


@WITH_A_WRITER_PROCESS_EXHAUSTIVE
def test_sigkill_at_fault_points_inside_validation_and_after_its_checkpoint(test_writer, reference, tmp_path):
    run_dir = str(tmp_path / "run")
    kills = 0
    # checkpoint 5 is the one written right after the validation at step 5: a best checkpoint
    for faults in ["validation_batch_end:2:sigkill", "validation_batch_end:5:sigkill",
                   "checkpoint_after_rename:5:sigkill", "epoch_end:1:sigkill", None]:
        process = start(run_dir, faults, "--patience", "50", stderr=subprocess.PIPE)
        _, stderr = process.communicate(timeout=TIMEOUT)
        assert process.returncode in (0, -signal.SIGKILL), stderr[-3000:]
        kills += killed_at_the_fault(process.returncode, stderr)  # with a writer process, checkpoint_* kill the writer
    assert kills >= 3
    assert_same_run(reference, run_dir)
    assert_same_best(reference, run_dir)
    assert_same_best(reference, run_dir)


def test_sigkill_at_random_instants(reference, tmp_path):
    rng = random.Random(2026)
    run_dir = str(tmp_path / "run")
    kills = 0
    for _ in range(6):
        process = start(run_dir, None, "--patience", "50", "--sleep", "0.05")
        line = process.stdout.readline()
        if not line.startswith("training"):
            process.wait(TIMEOUT)
            assert process.returncode == 0
            break
        time.sleep(rng.uniform(0.05, 1.0))
        process.send_signal(signal.SIGKILL)
        process.wait(TIMEOUT)
        kills += process.returncode == -signal.SIGKILL
    process = start(run_dir, None, "--patience", "50")
    process.communicate(timeout=TIMEOUT)
    assert process.returncode == 0
    assert kills >= 3
    assert_same_run(reference, run_dir)
    assert_same_best(reference, run_dir)
