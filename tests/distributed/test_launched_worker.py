"""A worker of ``python -m engine launch`` (in-process): it stops at once when it enters fit
after the launcher died, and its stop reason names the signal that reached the launcher (or
that engine.submitit passed on), not the one it was sent."""

from __future__ import annotations

import fcntl
import os
import pathlib
import signal
from typing import Iterator

import pytest

from engine.distributed import _prctl, preemption_marker
from engine.run.preemption import forget_passed_on, pass_on, preemption_reason


@pytest.fixture
def received(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The signals SIGTERM's and SIGUSR1's handlers got; this process as a launched worker in fit."""
    got: list[int] = []
    monkeypatch.setattr(preemption_marker, "_registered_signal", None)
    previous = {number: signal.signal(number, lambda number, frame: got.append(number))
                for number in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield got
    finally:
        _prctl.set_parent_death_signal(0)  # registering asked for one; this is a test process
        for number, handler in previous.items():
            signal.signal(number, handler)


def launch_directory(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    workers = tmp_path / "workers"
    workers.mkdir()
    monkeypatch.setenv(preemption_marker.WORKERS_VARIABLE, str(workers))
    return workers


def register_under_a_live_launcher(workers: pathlib.Path, number: int) -> None:
    """Register as fit does while a launcher holds its lock (this test, on a file of its own)."""
    lock = os.open(workers / preemption_marker.LAUNCHER_LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        preemption_marker.register_launched_worker([number])
    finally:
        os.close(lock)


def test_a_worker_entering_fit_after_the_launcher_died_asks_itself_to_stop(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, received: list[int], capfd) -> None:
    workers = launch_directory(tmp_path, monkeypatch)
    (workers / preemption_marker.LAUNCHER_LOCK).touch()  # a launcher's, which nobody holds any more
    preemption_marker.register_launched_worker([signal.SIGUSR1])
    assert received == [signal.SIGUSR1]
    assert "the launcher (python -m engine launch) has gone" in capfd.readouterr().err


def test_a_worker_under_a_live_launcher_registers_and_trains(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, received: list[int]) -> None:
    workers = launch_directory(tmp_path, monkeypatch)
    register_under_a_live_launcher(workers, signal.SIGUSR1)
    assert received == []
    assert preemption_marker.registered_workers(str(workers)) == {os.getpid(): signal.SIGUSR1}


@pytest.mark.parametrize("arrived", [signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM], ids=lambda n: n.name)
def test_the_stop_reason_names_the_signal_that_reached_the_launcher(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, received: list[int], arrived: int) -> None:
    workers = launch_directory(tmp_path, monkeypatch)
    register_under_a_live_launcher(workers, signal.SIGTERM)
    assert preemption_reason(signal.SIGTERM) == "preempted by SIGTERM"  # no request from the launcher yet
    preemption_marker.record_launch_request(str(workers), arrived)
    assert preemption_reason(signal.SIGTERM) == f"preempted by {signal.Signals(arrived).name}"
    # A signal the launcher does not send this worker came from elsewhere: named as it is.
    assert preemption_reason(signal.SIGUSR1) == "preempted by SIGUSR1"
    assert preemption_marker.registered_workers(str(workers)) == {os.getpid(): signal.SIGTERM}


def test_a_signal_passed_on_as_another_is_named_as_the_one_that_arrived(received: list[int]) -> None:
    try:
        pass_on(signal.SIGUSR2, signal.SIGTERM)
        assert received == [signal.SIGTERM]
        assert preemption_reason(signal.SIGTERM) == "preempted by SIGUSR2"
    finally:
        forget_passed_on()
    assert preemption_reason(signal.SIGTERM) == "preempted by SIGTERM"
