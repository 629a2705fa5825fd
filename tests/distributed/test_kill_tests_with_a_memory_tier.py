"""Every torchrun kill test of dist_train.py jobs run again with a memory tier
(SPLITLOOP_TEST_MEMORY_TIER=1: each job checkpoints every split into /dev/shm, durably every 50
splits, with peer copies when it spans two nodes), one pytest process per file; and again with
the memory tier and every job's checkpoints written by writer processes
(SPLITLOOP_TEST_WRITER=process, CheckpointConfig(writer="process")). Exhaustive: minutes per
file. The same by hand:
``SPLITLOOP_TEST_MEMORY_TIER=1 SPLITLOOP_TEST_WRITER=process .venv/bin/python -m pytest -n 0 FILE``."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from dist_train import MEMORY_TIER_SWITCH, SWITCHED_TIERS, WRITER_SWITCH  # noqa: E402

ROOT = pathlib.Path(__file__).parents[2]

KILL_TEST_FILES = {
    "tests/distributed/test_torchrun.py": [
        # These read the run dir's checkpoints (one per split there, one in 50 here).
        "test_ranks_hold_different_per_rank_state_and_equal_parameters",
        "test_a_diverged_replica_stops_the_commit",
    ],
    "tests/distributed/test_group_restarts.py": [],
    "tests/distributed/test_validation_ranks.py": [],
    # Exhaustive tests only: run with -m "exhaustive or not exhaustive".
    "tests/distributed/test_preemption_phases.py": [],
}
# With writer processes, also not these: their SIGTERM is sent by a fault point of the commit
# path, which then fires in the writer process (it ignores SIGTERM, to commit the preemption
# checkpoint), not in the training process they preempt.
NOT_WITH_WRITER_PROCESSES = [
    "tests/distributed/test_preemption_phases.py::test_sigterm_to_one_rank_at_fault_points[in-commit]",
    "tests/distributed/test_preemption_phases.py::test_sigterm_to_one_rank_at_fault_points[commit-start]",
]
EXHAUSTIVE_ONLY = {"tests/distributed/test_preemption_phases.py"}
# Not here: test_rollback_torchrun (Rollback under torchrun with a memory tier is refused, see
# tests/distributed/test_memory_tier.py).


@pytest.mark.exhaustive
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("writer", ["as-the-test-says", "process"])
@pytest.mark.parametrize("path", sorted(KILL_TEST_FILES))
def test_the_torchrun_kill_tests_pass_with_a_memory_tier(path: str, writer: str) -> None:
    names = [f"{path}::{name}" for name in KILL_TEST_FILES[path]]
    names += [node for node in NOT_WITH_WRITER_PROCESSES if writer == "process" and node.startswith(f"{path}::")]
    deselected = [argument for node in names for argument in ("--deselect", node)]
    markers = ["-m", "exhaustive or not exhaustive"] if path in EXHAUSTIVE_ONLY else []
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *markers, path, *deselected]
    switches = {MEMORY_TIER_SWITCH: "1", **({WRITER_SWITCH: "process"} if writer == "process" else {})}
    try:
        result = subprocess.run(command, cwd=ROOT, env=dict(os.environ, **switches),
                                capture_output=True, text=True, timeout=1500)
    finally:
        for leftover in pathlib.Path("/dev/shm").glob(pathlib.Path(SWITCHED_TIERS).name + "*"):
            shutil.rmtree(leftover, ignore_errors=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and " failed" not in result.stdout, result.stdout[-3000:]
