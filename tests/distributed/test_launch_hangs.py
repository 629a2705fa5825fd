"""``python -m engine launch`` and hangs: it names a rank that never arrives and ends the attempt,
maps a worker's hang to 86 and a crash loop to 87 (ending the job at once). The job is a
torch-free stand-in for torchrun whose workers publish real progress words
(tests/distributed/fake_watched_job.py); the torchrun runs are in tests/watchdog/."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from engine.watchdog import CRASH_LOOP_EXIT_CODE, HANG_EXIT_CODE

import launch_helpers
from torchrun_helpers import REPOSITORY

FAKE_JOB = str(pathlib.Path(__file__).with_name("fake_watched_job.py"))


def run_job(tmp_path: pathlib.Path, *kinds: str, options: tuple[str, ...] = ("--arrival-timeout", "1")) \
        -> tuple[int, str, set[int]]:
    """The launcher's status and stderr, and the processes of the job still alive after it ended."""
    job = subprocess.Popen([sys.executable, "-m", "engine", "launch", *options, "--", sys.executable, FAKE_JOB, *kinds],
                           stderr=subprocess.PIPE, text=True, start_new_session=True,
                           env={**os.environ, "PYTHONPATH": REPOSITORY, "TMPDIR": str(tmp_path)})
    seen: set[int] = set()
    try:
        while job.poll() is None:
            seen |= launch_helpers.descendants(job.pid)
            try:
                job.wait(0.2)
            except subprocess.TimeoutExpired:
                pass
        stderr = job.stderr.read() if job.stderr else ""
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait()
    return job.returncode, stderr, launch_helpers.alive(seen)


def test_a_rank_without_a_word_while_another_waits_is_named_and_ends_the_attempt_with_86(tmp_path) -> None:
    status, stderr, left = run_job(tmp_path, "arrives", "silent")
    assert status == HANG_EXIT_CODE, stderr
    assert "rank 1 (pid" in stderr and "never arrived" in stderr and "published no progress word" in stderr, stderr
    assert "while rank(s) 0 wait for it" in stderr and "SIGKILL of rank 1" in stderr, stderr
    assert "rank 0 (pid" not in stderr, stderr
    assert not left
    assert not list(tmp_path.glob("splitloop-*"))  # the launch's own files are gone


def test_a_rank_still_starting_is_named_with_its_phase(tmp_path) -> None:
    status, stderr, _ = run_job(tmp_path, "starting", "arrives")
    assert status == HANG_EXIT_CODE, stderr
    assert "rank 0 (pid" in stderr and "still says 'starting' (restoring)" in stderr and "rank(s) 1 wait" in stderr, stderr


def test_ranks_that_arrive_are_left_alone_and_the_status_passes_through(tmp_path) -> None:
    status, stderr, _ = run_job(tmp_path, "arrives_then_exits", "arrives_then_exits")
    assert (status, stderr) == (0, "")


def test_a_job_that_publishes_no_word_is_not_watched(tmp_path) -> None:
    # A script that does not run the engine's fit (or runs it with watchdog=None) is never blamed.
    status, stderr, _ = run_job(tmp_path, "silent_then_exits", "silent_then_exits")
    assert (status, stderr) == (0, "")


def test_a_worker_hang_becomes_86(tmp_path) -> None:
    status, stderr, left = run_job(tmp_path, "hang", "arrives", options=())
    assert status == HANG_EXIT_CODE, stderr
    assert "failed after 1 hang report(s), the first: rank 0 hung in phase 'step'" in stderr, stderr
    assert not left


def test_a_crash_loop_ends_the_job_with_87_and_is_not_requeued(tmp_path) -> None:
    status, stderr, left = run_job(tmp_path, "crash_loop", "arrives", options=("--requeue",))
    assert status == CRASH_LOOP_EXIT_CODE, stderr
    assert "deterministic failure at split 3" in stderr and "do not requeue" in stderr, stderr
    assert "requeue" not in stderr.replace("do not requeue", ""), stderr  # no scontrol attempt
    assert not left


def test_the_arrival_timeout_must_be_positive() -> None:
    from engine.cli.main import main

    with pytest.raises(SystemExit) as stop:
        main(["launch", "--arrival-timeout", "0", "--", sys.executable, "-c", "pass"])
    assert stop.value.code == 2


# Exhaustive: two torchrun jobs of 2 ranks (the reference and one restarted after ~30 s), over a
# minute of wall time on 2 cores; the default run keeps the stand-in jobs above, which exercise the
# same watch on real progress words.
@pytest.mark.exhaustive
@pytest.mark.slow
def test_under_torchrun_a_rank_stuck_before_fit_is_named_and_the_restarted_group_ends_exactly(tmp_path) -> None:
    import torchrun_helpers as helpers

    options = ("--epochs", "1", "--start-timeout", "200")  # the ranks waiting to join outwait the launcher
    reference = helpers.uninterrupted(tmp_path / "reference", 2, *options)
    run_dir, out_dir = tmp_path / "job" / "run", tmp_path / "job" / "out"
    out_dir.mkdir(parents=True)
    torchrun = helpers.torchrun_command(2, run_dir, out_dir, *options, max_restarts=1)  # fresh ranks: the launcher's children
    process = helpers.run([sys.executable, "-m", "engine", "launch", "--arrival-timeout", "30", "--", *torchrun],
                          helpers.environment(HANG_BEFORE_FIT="0/1"))
    assert process.returncode == 0, process.stderr[-4000:]
    assert re.search(r"rank 1 \(pid \d+\) on \S+ never arrived: \d+ s after it started it has published no progress "
                     r"word", process.stderr), process.stderr[-4000:]
    assert "while rank(s) 0 wait for it" in process.stderr
    helpers.assert_same_result(reference, tmp_path / "job", 2)
