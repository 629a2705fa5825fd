"""Preemption while a validation pass runs, with real processes: the validation DataLoader's
worker processes outlive a SIGTERM sent to the process group (as ``scancel`` sends it), the pass
finishes, the run commits a checkpoint at the boundary that follows it, exits 75, and the resumed
run is bit-identical to one never interrupted (weights, every state, every metrics.jsonl row)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

import forkserver
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from resume_helpers import assert_same_run
from validated_worker_training import train

TESTS = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = str(TESTS / "validated_worker_training.py")
ENVIRONMENT = dict(os.environ, PYTHONPATH=str(TESTS.parent))  # tests/progress must not hide the package
TIMEOUT = 120

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, str]:
    """Uninterrupted runs, with plain and with persistent workers."""
    runs = {}
    for persistent in (False, True):
        runs[persistent] = str(tmp_path_factory.mktemp(f"reference-{persistent}"))
        train(runs[persistent], persistent)
    return runs


def run_and_signal_group_in_pause(run_dir: str, handshake: pathlib.Path, *options: str) -> tuple[int, str]:
    """Start the training script, SIGTERM its process group while it pauses (in a validation
    batch or a callback's loader, see ``options``), and return (exit status, stderr)."""
    handshake.mkdir()
    command = [sys.executable, SCRIPT, run_dir, "--handshake", str(handshake), *options]
    process = forkserver.popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env=ENVIRONMENT)  # its own group, as a batch job
    try:
        while not (handshake / "validating").exists():
            assert process.poll() is None, f"the run ended ({process.returncode}) before its pause"
            try:
                process.wait(timeout=0.02)
            except subprocess.TimeoutExpired:
                pass
        os.killpg(process.pid, signal.SIGTERM)  # the main process and every worker, training's and validation's
        (handshake / "go").write_text("")
        _, stderr = process.communicate(timeout=TIMEOUT)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, stderr


# Validation batch 5 is inside the pass after step 4 (a split boundary); 17 inside the pass at the
# end of epoch 0 (12 validation batches per pass).
@pytest.mark.parametrize("pause_at, persistent", [(5, False), (17, True)],
                         ids=["mid-epoch-pass-workers", "epoch-end-pass-persistent-workers"])
def test_sigterm_to_the_group_during_validation_commits_exits_75_and_resumes_exactly(
        references: dict[bool, str], tmp_path: pathlib.Path, pause_at: int, persistent: bool) -> None:
    run_dir = str(tmp_path / "run")
    options = ["--pause-at", str(pause_at)] + (["--persistent"] if persistent else [])
    status, stderr = run_and_signal_group_in_pause(run_dir, tmp_path / "handshake", *options)
    assert status == 75, stderr[-3000:]
    assert "preempted by SIGTERM" in stderr and "killed by signal" not in stderr

    store = CheckpointStore(Storage(run_dir))
    stopped = store.latest()
    assert stopped is not None and stopped.progress.records["evaluation.validations"].total.completed == 1 + (pause_at > 12)
    # The pass that was running finished before the stop: the checkpoint holds its result.
    assert stopped.state["loops"]["evaluation"]["validated_at_step"] == stopped.progress.records["flow.optimizer_steps"].total.completed

    result = train(run_dir, persistent)
    assert result.resumed_from == stopped.name
    assert_same_run(references[persistent], run_dir)


def test_sigterm_to_the_group_while_a_callback_iterates_its_own_preemption_safe_loader(
        references: dict[bool, str], tmp_path: pathlib.Path) -> None:
    run_dir = str(tmp_path / "run")
    status, stderr = run_and_signal_group_in_pause(run_dir, tmp_path / "handshake", "--probe")
    assert status == 75, stderr[-3000:]
    assert "preempted by SIGTERM" in stderr and "killed by signal" not in stderr
    stopped = CheckpointStore(Storage(run_dir)).latest()
    assert stopped is not None and stopped.progress.cursor.batch == 2  # the boundary after the callback's pause

    result = train(run_dir)
    assert result.resumed_from == stopped.name
    assert_same_run(references[False], run_dir)
