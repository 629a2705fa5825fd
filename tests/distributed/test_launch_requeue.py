"""``python -m engine launch --requeue [--signal NAME]``: after a committed preemption the
launcher runs ``scontrol requeue $SLURM_JOB_ID`` itself (a fake scontrol on PATH records it);
only for the ``--signal`` given; without scontrol it says so and exits 75 as before."""

from __future__ import annotations

import os
import pathlib
import signal
import stat
import subprocess
import sys

import pytest

from engine.cli.main import main
from engine.distributed.requeue import RequeuePolicy, parse_signal

import launch_helpers
from test_launch import FAKE_TORCHRUN, wait_for_agent
from torchrun_helpers import REPOSITORY

JOB_ID = "4242"
FAKE_SCONTROL = """#!/bin/bash
echo "$*" >> "$SCONTROL_LOG"
"""


def fake_slurm(tmp_path: pathlib.Path, with_scontrol: bool = True) -> dict[str, str]:
    """The environment of a SLURM job whose PATH holds a fake scontrol (or none)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if with_scontrol:
        (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
        (bin_dir / "scontrol").chmod(stat.S_IRWXU)
    path = f"{bin_dir}:{pathlib.Path(sys.executable).parent}"  # nothing else: no real scontrol either
    return {**os.environ, "PATH": path, "SLURM_JOB_ID": JOB_ID, "SCONTROL_LOG": str(tmp_path / "scontrol.log"),
            "PYTHONPATH": REPOSITORY}


def preempt(tmp_path: pathlib.Path, number: int, *options: str, with_scontrol: bool = True) -> tuple[int, str]:
    """A fake torchrun job under the launcher, sent ``number`` once its workers registered; the
    launcher's status and stderr."""
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "engine", "launch", *options, "--", sys.executable, FAKE_TORCHRUN, str(out),
               "commit", "waits"]
    job = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True,
                           env=fake_slurm(tmp_path, with_scontrol))
    processes = wait_for_agent(out, job)
    os.kill(job.pid, number)
    _, stderr = job.communicate(timeout=60)
    assert not launch_helpers.alive(processes)
    return job.returncode, stderr


def requeues(tmp_path: pathlib.Path) -> list[str]:
    log = tmp_path / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


def test_sigusr1_requeues_the_job_with_its_id(tmp_path: pathlib.Path) -> None:
    status, stderr = preempt(tmp_path, signal.SIGUSR1, "--requeue", "--signal", "USR1")
    assert status == 75, stderr
    assert requeues(tmp_path) == [f"requeue {JOB_ID}"]
    assert f"requeued job {JOB_ID}" in stderr


def test_another_signal_than_the_configured_one_is_not_requeued(tmp_path: pathlib.Path) -> None:
    status, stderr = preempt(tmp_path, signal.SIGTERM, "--requeue", "--signal", "SIGUSR1")
    assert status == 75, stderr
    assert requeues(tmp_path) == []
    assert "came by SIGTERM, not --signal SIGUSR1: not requeued" in stderr


def test_without_signal_any_preemption_is_requeued(tmp_path: pathlib.Path) -> None:
    status, stderr = preempt(tmp_path, signal.SIGTERM, "--requeue")
    assert status == 75, stderr
    assert requeues(tmp_path) == [f"requeue {JOB_ID}"]


def test_without_requeue_nothing_is_requeued(tmp_path: pathlib.Path) -> None:
    status, stderr = preempt(tmp_path, signal.SIGUSR1)
    assert status == 75, stderr
    assert requeues(tmp_path) == []


def test_without_scontrol_it_says_so_and_exits_75(tmp_path: pathlib.Path) -> None:
    status, stderr = preempt(tmp_path, signal.SIGUSR1, "--requeue", with_scontrol=False)
    assert status == 75, stderr
    assert "--requeue: scontrol is not on PATH; not requeued" in stderr


def test_a_command_that_ends_without_a_preemption_is_not_requeued(tmp_path: pathlib.Path, monkeypatch) -> None:
    for name, value in fake_slurm(tmp_path).items():
        monkeypatch.setenv(name, value)
    assert main(["launch", "--requeue", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert requeues(tmp_path) == []


def test_signal_without_requeue_and_a_bad_signal_name_are_refused(capsys) -> None:
    assert main(["launch", "--signal", "USR1", "--", sys.executable, "-c", "pass"]) == 1
    assert "--signal names the signal whose preemption is requeued: it needs --requeue" in capsys.readouterr().err
    assert main(["launch", "--requeue", "--signal", "NOPE", "--", sys.executable, "-c", "pass"]) == 1
    assert "'NOPE' is not a signal name" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["USR1", "SIGUSR1", "usr1", str(int(signal.SIGUSR1))])
def test_signal_names_and_numbers_are_read_alike(name: str) -> None:
    assert parse_signal(name) == signal.SIGUSR1


def test_a_preemption_the_workers_got_directly_is_judged_by_its_reason() -> None:
    policy = RequeuePolicy(frozenset({int(signal.SIGUSR1)}))
    assert policy.applies_to(None, "preempted by SIGUSR1")
    assert not policy.applies_to(None, "preempted by SIGTERM")
    assert RequeuePolicy().applies_to(None, None)
