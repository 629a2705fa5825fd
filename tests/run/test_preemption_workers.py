"""Preemption of a job whose DataLoader has worker processes. ``scancel`` and a SLURM time
limit signal the whole process group: the workers ignore the signal, the main process finishes
its split, commits a checkpoint, exits with the preemption code, and the resume is exact."""

import json
import os
import signal
import subprocess
import sys

import pytest

import forkserver
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from resume_helpers import assert_same_run, read_metrics
from worker_training import train

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(TESTS, "worker_training.py")
NO_PERIODIC_CHECKPOINT = 1000


def environment():
    """The repository root after tests/ on the path: tests/progress/ must not hide the package."""
    return dict(os.environ, PYTHONPATH=os.path.dirname(TESTS))


@pytest.mark.slow
@pytest.mark.parametrize("persistent, test_writer", [
    (False, None), (True, None),
    (False, "process"),  # the writer process is in the group too: it ignores the signal
    pytest.param(True, "process", marks=pytest.mark.exhaustive),
], indirect=["test_writer"], ids=["workers", "persistent_workers", "workers-writer-process",
                                  "persistent_workers-writer-process"])
def test_sigterm_to_the_process_group_exits_75_with_a_checkpoint_and_resumes_exactly(persistent, test_writer,
                                                                                     tmp_path):
    reference = str(tmp_path / "reference")
    train(reference, persistent, every=NO_PERIODIC_CHECKPOINT)
    run_dir = str(tmp_path / "run")
    command = [sys.executable, SCRIPT, run_dir, "--sleep", "0.2", "--every", str(NO_PERIODIC_CHECKPOINT)]
    if persistent:
        command.append("--persistent")
    process = forkserver.popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env=environment())  # its own group, as a batch job
    try:
        assert process.stdout.readline().strip() == "training"
        os.killpg(process.pid, signal.SIGTERM)  # what scancel does: the main process and its workers
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 75, stderr[-3000:]
    assert "preempted by SIGTERM" in stderr and "killed by signal" not in stderr
    assert "checkpoint writer process" not in stderr  # no writer process died of the signal

    names = CheckpointStore(Storage(run_dir)).committed_names()
    assert len(names) == 1  # the preemption checkpoint, no periodic one
    checkpoint = CheckpointStore(Storage(run_dir)).latest()
    last_line = json.loads(read_metrics(run_dir).splitlines()[-1])
    assert (last_line["epoch"], last_line["batch"]) == checkpoint.progress.cursor.as_tuple()[:2]  # no work lost

    result = train(run_dir, persistent, every=NO_PERIODIC_CHECKPOINT)
    assert result.resumed_from == names[0]
    assert_same_run(reference, run_dir)
