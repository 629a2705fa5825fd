"""engine.submitit.Checkpointable under submitit's LocalExecutor: the job gets submitit's
preemption signal mid-run, commits at the next boundary, is resubmitted by submitit (its
checkpoint() protocol), resumes, and ends bit-identical to a run never preempted. A signal
that comes before fit or after it is requeued as well (nothing to commit there)."""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import time

import pytest

import engine
import engine.submitit
from resume_helpers import assert_same_run
from scenarios import train_with_checkpoints
from submitit_scenario import PHASES, train

submitit = pytest.importorskip("submitit")  # the `test` extra installs it
TESTS = pathlib.Path(__file__).resolve().parent.parent


def wait_for(path: pathlib.Path, job) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert not job.done(), job.stderr()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@pytest.mark.slow
# By default a preemption inside a split; before fit and after fit (the same requeue path, a run
# not started or finished) in the exhaustive run (CI time: about 20 s each).
@pytest.mark.parametrize("phase", [phase if phase == "split" else pytest.param(phase, marks=pytest.mark.exhaustive)
                                   for phase in PHASES])
def test_a_preempted_job_is_resubmitted_and_ends_exact(tmp_path, monkeypatch, phase: str):
    reference = str(tmp_path / "reference")
    train_with_checkpoints("tbptt", reference, every=4)
    run_dir = str(tmp_path / "run")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    executor = submitit.LocalExecutor(folder=str(tmp_path / "logs"))
    executor.update_parameters(timeout_min=10)
    job = executor.submit(engine.submitit.Checkpointable(train), run_dir, phase)
    pid_file = pathlib.Path(f"{run_dir}.pid")
    wait_for(pid_file, job)
    first_pid = int(pid_file.read_text())
    # What the controller sends before the time limit. job._interrupt() signals the controller,
    # which does not pass it on: the task's own pid gets it (docs/faults.md).
    os.kill(first_pid, submitit.JobEnvironment._usr_sig())
    pathlib.Path(f"{run_dir}.signalled").write_text("")
    outcome = job.result()
    log = (job.stderr() or "") + (job.stdout() or "")
    assert outcome["pid"] != first_pid, log[-4000:]  # a second process: submitit resubmitted the job
    assert (outcome["resumed_from"] is not None) == (phase != "before fit")
    assert_same_run(reference, run_dir)
    if phase == "split":
        assert "preempted by SIGUSR2" in log, log[-4000:]


def test_checkpoint_returns_the_same_call_for_resubmission():
    wrapped = engine.submitit.Checkpointable(train)
    delayed = wrapped.checkpoint("runs/x")
    assert isinstance(delayed, submitit.helpers.DelayedSubmission)
    assert delayed.function is wrapped and delayed.args == ("runs/x",)


def test_a_non_callable_is_refused():
    with pytest.raises(engine.ConfigError, match="expected a callable training function"):
        engine.submitit.Checkpointable("train.py")


def test_importing_engine_does_not_import_submitit():
    import subprocess

    code = "import sys, engine; assert 'submitit' not in sys.modules, 'imported'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
