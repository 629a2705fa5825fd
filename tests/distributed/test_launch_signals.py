"""``python -m engine launch`` owns the preemption signals of a torchrun job (2 gloo ranks on
the CPU): SIGUSR1 or SIGTERM, to the launcher only, to its process group or to every process,
once or three times, during training or during validation, always ends in one committed
preemption checkpoint, exit status 75, no process of the job alive and no marker left; the
resumed run ends bit-identical to an uninterrupted one. The default run covers a representative
few; the whole matrix is marked ``exhaustive``."""

from __future__ import annotations

import itertools
import pathlib
import signal
import subprocess
import sys

import pytest

import launch_helpers
import torchrun_helpers as helpers

pytestmark = pytest.mark.slow


def launch_command(run_dir: pathlib.Path, out_dir: pathlib.Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "engine", "launch", "--",
            *helpers.torchrun_command(2, run_dir, out_dir, *options, max_restarts=1)]


def check_preemption(tmp_path: pathlib.Path, phase: str, target: str, number: int, times: int) -> pathlib.Path:
    """Start the job through the launcher, signal it in ``phase``, check the outcome; the job's
    directory (run/ and out/)."""
    job_dir = tmp_path / "job"
    run_dir, out_dir, temp_dir = job_dir / "run", job_dir / "out", tmp_path / "tmp"
    out_dir.mkdir(parents=True)
    temp_dir.mkdir()
    with subprocess.Popen(launch_command(run_dir, out_dir, *launch_helpers.phase_options(phase)),
                          env=helpers.environment(TMPDIR=str(temp_dir)), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=helpers.REPOSITORY, start_new_session=True) as job:
        launch_helpers.wait_for_phase(out_dir, phase, job)
        job_processes = launch_helpers.send(job, target, number, times)
        _, stderr = job.communicate(timeout=helpers.TIMEOUT)
    case = f"{signal.Signals(number).name} x{times} to {target} during {phase}"
    assert job.returncode == 75, f"{case}: " + stderr[-4000:]
    workers = {helpers.worker_pid(out_dir, rank) for rank in (0, 1)}
    assert None not in workers
    assert not launch_helpers.alive(job_processes | workers), f"{case}: processes of the job left running"
    checkpoints = launch_helpers.committed(run_dir)
    assert len(checkpoints) == 1, f"{case}: {checkpoints}"  # --every 1000: the preemption's only
    assert f"checkpoint {checkpoints[0]} committed; exiting with 75" in stderr, stderr[-4000:]
    # The stop names the signal that came (the workers were sent their own, SIGTERM).
    assert f"the run was preempted (preempted by {signal.Signals(number).name})" in stderr, stderr[-4000:]
    assert helpers.worker_pid(out_dir, 0, restart=1) is None, f"{case}: torchrun restarted the workers"
    assert not launch_helpers.launch_directories(temp_dir), f"{case}: the launch left its marker directory"
    return job_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """An uninterrupted run with the options of the training-phase case."""
    tmp = tmp_path_factory.mktemp("launch-reference")
    process, _, _ = helpers.train(tmp, "job", 2, "--every", "1000")
    assert process.returncode == 0, process.stderr[-4000:]
    return tmp / "job"


@pytest.mark.exhaustive  # the default run covers the launcher path in test_sbatch_recipes (torchrun-launcher-training)
def test_sigusr1_repeated_to_the_launcher_only_commits_once_exits_75_and_resumes_exactly(
        reference: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # SLURM's --signal=B:USR1 with the launcher exec'd: torchrun (which dies of SIGUSR1) never
    # sees it, nor do the workers; only the launcher can pass the request on.
    job_dir = check_preemption(tmp_path, "training", "launcher", signal.SIGUSR1, times=3)
    resumed = subprocess.run(launch_command(job_dir / "run", job_dir / "out", "--every", "1000"),
                             env=helpers.environment(), capture_output=True, text=True, timeout=helpers.TIMEOUT,
                             cwd=helpers.REPOSITORY)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    helpers.assert_same_result(reference, job_dir, 2)


@pytest.mark.exhaustive  # CI time: a signal during validation is the default sbatch case several-nodes-every-validation
def test_sigterm_repeated_to_the_process_group_during_validation(tmp_path: pathlib.Path) -> None:
    check_preemption(tmp_path, "validation", "group", signal.SIGTERM, times=3)


@pytest.mark.exhaustive  # the sbatch recipe several-nodes-every-validation covers it by default
def test_sigusr1_to_every_process_during_validation(tmp_path: pathlib.Path) -> None:
    # As SLURM's --signal=USR1 (no B:) or scancel --signal=USR1: torchrun gets it too.
    check_preemption(tmp_path, "validation", "every", signal.SIGUSR1, times=1)


def test_a_job_of_one_process_is_not_restarted_after_the_stop(tmp_path: pathlib.Path) -> None:
    # A lone worker used to exit 75, which torchrun answers with a restart; the restarted worker
    # got the launcher's request again, and torchrun ended with 1 once out of restarts.
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    out_dir.mkdir()
    command = [sys.executable, "-m", "engine", "launch", "--",
               *helpers.torchrun_command(1, run_dir, out_dir, "--every", "1000", *launch_helpers.SLOW, max_restarts=2)]
    with subprocess.Popen(command, env=helpers.environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=helpers.REPOSITORY, start_new_session=True) as job:
        launch_helpers.wait_for_phase(out_dir, "training", job, ranks=1)
        launch_helpers.send(job, "launcher", signal.SIGUSR1, times=1)
        _, stderr = job.communicate(timeout=helpers.TIMEOUT)
    assert job.returncode == 75, stderr[-4000:]
    assert helpers.worker_pid(out_dir, 0, restart=1) is None, "torchrun restarted the worker"
    assert len(launch_helpers.committed(run_dir)) == 1


@pytest.mark.exhaustive  # CI time: the default run stops a torchrun job through the launcher in test_sbatch_recipes
def test_workers_torchrun_restarts_after_the_preemption_commit_do_not_train_or_commit_again(
        reference: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # One worker fails after the commit: torchrun restarts the group, and the restarted workers
    # used to resume, be asked to stop by the launcher, and commit a second checkpoint.
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    out_dir.mkdir()
    command = launch_command(run_dir, out_dir, *launch_helpers.phase_options("training"),
                             "--fail-after-preemption-rank", "1")
    with subprocess.Popen(command, env=helpers.environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=helpers.REPOSITORY, start_new_session=True) as job:
        launch_helpers.wait_for_phase(out_dir, "training", job)
        launch_helpers.send(job, "launcher", signal.SIGUSR1, times=1)
        _, stderr = job.communicate(timeout=helpers.TIMEOUT)
    assert job.returncode == 75, stderr[-4000:]
    assert helpers.worker_pid(out_dir, 0, restart=1) is not None, "torchrun did not restart the workers"
    assert len(launch_helpers.committed(run_dir)) == 1, stderr[-4000:]
    assert "a worker started after that does not train" in stderr
    resumed = subprocess.run(launch_command(run_dir, out_dir, "--every", "1000"), env=helpers.environment(),
                             capture_output=True, text=True, timeout=helpers.TIMEOUT, cwd=helpers.REPOSITORY)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    helpers.assert_same_result(reference, tmp_path, 2)


MATRIX = list(itertools.product(launch_helpers.PHASES, launch_helpers.TARGETS, (signal.SIGUSR1, signal.SIGTERM), (1, 3)))


@pytest.mark.exhaustive
@pytest.mark.parametrize("phase, target, number, times", MATRIX,
                         ids=[f"{p}-{t}-{n.name}-x{k}" for p, t, n, k in MATRIX])
def test_every_signal_target_and_phase(tmp_path: pathlib.Path, phase: str, target: str, number: int, times: int) -> None:
    check_preemption(tmp_path, phase, target, number, times)
