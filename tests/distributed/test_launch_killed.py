"""A SIGKILLed ``python -m engine launch`` leaves no process of its torchrun job training: the
kernel SIGKILLs torchrun with it, and each worker, asked to stop by the kernel when torchrun
died, finishes its split, commits and ends (2 gloo ranks on the CPU, fresh processes)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

import launch_helpers
import torchrun_helpers as helpers

pytestmark = pytest.mark.slow

# A split takes 0.2 s (--slow): the workers' stop is one split, an agreement and one commit away,
# while the run has minutes of training left (EPOCHS): a worker still running then trains on.
ENDED_WITHIN_SECONDS = 20
EPOCHS = "40"


@pytest.mark.exhaustive  # CI time (about 17 s: the default run keeps launch's own signal tests (test_launch_signals))
def test_a_sigkilled_launcher_leaves_no_worker_training(tmp_path: pathlib.Path) -> None:
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    out_dir.mkdir()
    command = [sys.executable, "-m", "engine", "launch", "--",
               *helpers.torchrun_command(2, run_dir, out_dir, *launch_helpers.phase_options("training"),
                                         "--epochs", EPOCHS)]
    with subprocess.Popen(command, env=helpers.environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, cwd=helpers.REPOSITORY, start_new_session=True) as job:
        launch_helpers.wait_for_phase(out_dir, "training", job)
        job_processes = launch_helpers.send(job, "launcher", signal.SIGKILL, times=1)
        deadline = time.monotonic() + ENDED_WITHIN_SECONDS
        while launch_helpers.alive(job_processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = launch_helpers.alive(job_processes)
        print(f"ended {time.monotonic() - deadline + ENDED_WITHIN_SECONDS:.1f} s after the kill")
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        _, stderr = job.communicate(timeout=helpers.TIMEOUT)  # the workers' stderr: the pipe closes when all ended
    assert job.returncode == -signal.SIGKILL
    assert len(job_processes) >= 4, job_processes  # the launcher, torchrun, two workers
    assert not left, f"still running {ENDED_WITHIN_SECONDS} s after the launcher's SIGKILL: {left}\n" + stderr[-4000:]
    # They stopped as after a preemption: at one boundary, with one checkpoint committed there.
    assert len(launch_helpers.committed(run_dir)) == 1, stderr[-4000:]
