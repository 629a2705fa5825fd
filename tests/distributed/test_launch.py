"""``python -m engine launch``: a committed preemption becomes exit status 75."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from engine.cli.main import main
from engine.distributed import preemption_marker

import launch_helpers
from torchrun_helpers import REPOSITORY


def test_the_launcher_imports_no_torch() -> None:
    # It only supervises the job: torch's import would cost seconds of CPU at every start.
    completed = subprocess.run([sys.executable, "-X", "importtime", "-m", "engine", "launch", "--", sys.executable, "-c", "pass"],
                               cwd=REPOSITORY, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    imported = {line.rpartition("|")[2].strip() for line in completed.stderr.splitlines() if line.startswith("import time:")}
    assert "engine.distributed.launch" in imported
    assert not {"torch", "numpy"} & imported


def test_the_command_status_passes_through_without_a_marker(tmp_path: pathlib.Path) -> None:
    assert main(["launch", "--marker", str(tmp_path / "m.json"), "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3


def test_a_marker_written_by_the_run_becomes_75(tmp_path: pathlib.Path) -> None:
    script = ("import os, json; json.dump({'reason': 'preempted by SIGTERM', 'checkpoint': 'ckpt-0000000004'}, "
              "open(os.environ['SPLITLOOP_PREEMPTION_MARKER'], 'w'))")
    marker = tmp_path / "m.json"
    assert main(["launch", "--marker", str(marker), "--", sys.executable, "-c", script]) == 75
    assert not marker.exists()
    assert main(["launch", "--marker", str(marker), "--exit-code", "99", "--", sys.executable, "-c", script]) == 99


def test_a_grace_that_is_not_a_positive_number_is_a_usage_error(capsys) -> None:
    for grace in ("0", "-1", "soon", "inf"):
        with pytest.raises(SystemExit) as stop:
            main(["launch", "--grace", grace, "--", sys.executable, "-c", "pass"])
        assert stop.value.code == 2
        assert "--grace" in capsys.readouterr().err


def test_a_stale_marker_of_an_earlier_run_is_ignored(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "m.json"
    marker.write_text(json.dumps({"reason": "old"}))
    assert main(["launch", "--marker", str(marker), "--", sys.executable, "-c", "pass"]) == 0


def test_a_preempted_worker_of_several_exits_0_under_torchrun_and_writes_the_marker(tmp_path: pathlib.Path, monkeypatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert preemption_marker.preempted_exit_status(75) == 75
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert preemption_marker.preempted_exit_status(75) == 75  # one worker: torchrun restarts it, as before
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert preemption_marker.preempted_exit_status(75) == 0
    monkeypatch.setenv(preemption_marker.MARKER_VARIABLE, str(tmp_path / "m.json"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert preemption_marker.preempted_exit_status(75) == 0  # under the launcher a restart would train on
    monkeypatch.setenv("WORLD_SIZE", "2")
    preemption_marker.write_preemption_marker("preempted by SIGTERM", "ckpt-0000000002")
    assert json.loads((tmp_path / "m.json").read_text())["checkpoint"] == "ckpt-0000000002"


FAKE_TORCHRUN = str(pathlib.Path(__file__).with_name("fake_torchrun.py"))


def start_fake_job(out: pathlib.Path, worker_kind: str, agent_kind: str, *launch_options: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "engine", "launch", *launch_options, "--",
               sys.executable, FAKE_TORCHRUN, str(out), worker_kind, agent_kind]
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": REPOSITORY})


def wait_for_agent(out: pathlib.Path, job: subprocess.Popen) -> set[int]:
    """The fake torchrun's and its workers' pids, once every worker registered."""
    while not (out / "agent").exists():
        assert job.poll() is None, job.stderr.read() if job.stderr else ""
        time.sleep(0.05)
    record = json.loads((out / "agent").read_text())
    return {record["pid"], *record["workers"]}


def test_a_worker_that_ignores_the_request_is_killed_after_the_grace(tmp_path: pathlib.Path) -> None:
    job = start_fake_job(tmp_path, "stubborn", "waits", "--grace", "1")
    processes = wait_for_agent(tmp_path, job)
    os.kill(job.pid, signal.SIGUSR2)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGKILL, stderr  # the fake torchrun, killed with its workers
    assert "SIGUSR2, but the run committed no preemption checkpoint" in stderr
    assert not launch_helpers.alive(processes)


def test_the_workers_a_dead_torchrun_left_are_stopped_and_waited_for(tmp_path: pathlib.Path) -> None:
    job = start_fake_job(tmp_path, "commit", "dies")
    processes = wait_for_agent(tmp_path, job)
    _, stderr = job.communicate(timeout=60)
    assert "ended with 2 process(es) left; stopping them" in stderr
    assert job.returncode == 75, stderr  # the orphaned rank 0 still committed and left the marker
    assert not launch_helpers.alive(processes)


def test_a_launcher_removes_what_killed_launchers_left(tmp_path: pathlib.Path) -> None:
    from engine.distributed.launch import remove_what_dead_launchers_left

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name in (f"splitloop-watchdog-launch-{dead.pid}-abc", f"splitloop-watchdog-launch-{os.getpid()}-def",
                 "splitloop-watchdog-launch-x-ghi", f"other-{dead.pid}-jkl"):
        (tmp_path / name).mkdir()
    remove_what_dead_launchers_left(str(tmp_path), "splitloop-watchdog-launch-")
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        [f"splitloop-watchdog-launch-{os.getpid()}-def", "splitloop-watchdog-launch-x-ghi", f"other-{dead.pid}-jkl"])
