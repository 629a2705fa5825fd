"""Every single-process kill and preemption test file run with checkpoints written by a writer
process (SPLITLOOP_TEST_WRITER=process, tests/writer_switch.py), one pytest process per file:
the matrix behind the default writer-process cases (test_preemption_workers, test_validation_kill,
test_workers and tests/checkpoint/writers/test_writer_process.py). Exhaustive: minutes per file.

The same by hand: ``SPLITLOOP_TEST_WRITER=process .venv/bin/python -m pytest -n 0 FILE``."""

import os
import pathlib
import subprocess
import sys

import pytest

from writer_switch import VARIABLE

ROOT = pathlib.Path(__file__).parent.parent

# Not here: tests/testing/test_harness.py checks engine.testing's harness, which arms faults in
# the training process (in process, or in the child it starts): the commit-protocol points fire
# in the writer process instead, so its checkpoint_* and filesystem_write trials read "never
# fired". The torchrun, fast-tier and object-store kill tests keep the thread writer (refused).
KILL_TEST_FILES = [
    "tests/run/test_kill.py",
    "tests/run/test_preemption.py",
    "tests/run/test_stop_reasons.py",
    "tests/run/test_preemption_workers.py",
    "tests/run/test_preemption_validation.py",
    "tests/run/test_validation_kill.py",
    "tests/run/test_save_on_exception.py",
    "tests/run/test_submitit.py",
    "tests/run/test_finished_runs.py",
    "tests/run/test_plateau.py",
    "tests/run/test_rollback.py",
    "tests/data/test_workers.py",
    "tests/data/test_stream_workers.py",
    "tests/data/test_streams.py",
    "tests/loops/test_precision.py",
    "tests/loggers/test_loggers.py",
    "tests/checkpoint/store/test_lease.py",
    "tests/checkpoint/test_budget.py",
    "tests/checkpoint/test_best_placement.py",
    "tests/lightning/test_kill_resume.py",
]

# What cannot hold with a writer process, and why (none since the writer process starts without
# torch: the random-instant kills of test_rollback and test_streams, whose starts waited for a
# writer process importing torch, now pass).
NOT_WITH_A_WRITER_PROCESS: list[str] = []


@pytest.mark.exhaustive
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("path", KILL_TEST_FILES)
def test_the_kill_tests_pass_with_a_writer_process(path):
    deselected = [argument for node in NOT_WITH_A_WRITER_PROCESS if node.startswith(f"{path}::")
                  for argument in ("--deselect", node)]
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", path, *deselected]
    result = subprocess.run(command, cwd=ROOT, env=dict(os.environ, **{VARIABLE: "process"}), capture_output=True,
                            text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
