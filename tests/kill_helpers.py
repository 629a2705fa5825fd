"""Run a scenario in a real subprocess, optionally armed to die at a fault point.

The processes are forked from the tests' fork server (tests/forkserver.py: torch imported
once) when it is available, else started with ``subprocess``; either way each is a real
process that is SIGKILLed and whose exit status the test observes."""

from __future__ import annotations

import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import engine
import forkserver

SCRIPT = str(pathlib.Path(__file__).with_name("scenarios.py"))
TIMEOUT = 120
# With a writer process (SPLITLOOP_TEST_WRITER=process, tests/writer_switch.py) the fault points
# of the commit protocol (checkpoint_*, filesystem_write) fire in the writer process: the writer
# is the process SIGKILLed there, and the training process says so, starts another, trains on.
WRITER_PROCESS_KILLED = re.compile(r"checkpoint writer process \(pid \d+\) exited with code -9")

# ``@WITH_A_WRITER_PROCESS``: the test runs twice, with the writer SPLITLOOP_TEST_WRITER says and
# with a writer process (the ``test_writer`` fixture of tests/conftest.py).
WITH_A_WRITER_PROCESS = pytest.mark.parametrize("test_writer", [None, "process"], indirect=True,
                                                ids=["writer-as-set", "writer-process"])
# The same, the writer-process run in the exhaustive suite only (a long test whose writer-process
# kills test_kill_tests_with_a_writer_process.py repeats there anyway).
WITH_A_WRITER_PROCESS_EXHAUSTIVE = pytest.mark.parametrize(
    "test_writer", [None, pytest.param("process", marks=pytest.mark.exhaustive)], indirect=True,
    ids=["writer-as-set", "writer-process"])


def killed_at_the_fault(returncode: int, stderr: str) -> bool:
    """Whether an armed SIGKILL fired in a training process that exited with ``returncode``
    and wrote ``stderr``: it died of it, or its writer process did."""
    return returncode == -signal.SIGKILL or WRITER_PROCESS_KILLED.search(stderr) is not None


def environment(faults: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SPLITLOOP_FAULTS", None)
    if faults:
        env["SPLITLOOP_FAULTS"] = faults
    return env


def run_scenario(name: str, run_dir: str, faults: str | None = None, *args: str,
                 script: str = SCRIPT) -> subprocess.CompletedProcess:
    """Train in a subprocess (``script NAME RUN_DIR ARGS``, scenarios.py by default); returns
    the completed process (returncode -9 when SIGKILLed)."""
    return forkserver.run([sys.executable, script, name, run_dir, *args], env=environment(faults),
                          capture_output=True, text=True, timeout=TIMEOUT)


def run_until_done(name: str, run_dir: str, faults: str, *args: str, limit: int = 80, script: str = SCRIPT) -> int:
    """Start the scenario again and again (each start armed with ``faults``) until a process
    finishes by itself; returns how many processes were killed on the way (with a writer
    process: the last one counts if its writer process was, see :func:`killed_at_the_fault`)."""
    kills = 0
    for _ in range(limit):
        process = run_scenario(name, run_dir, faults, *args, script=script)
        if process.returncode == 0:
            return kills + killed_at_the_fault(process.returncode, process.stderr)
        assert process.returncode == -signal.SIGKILL, process.stderr[-3000:]
        kills += 1
    raise AssertionError(f"{name} did not finish within {limit} starts")


def kill_at_random_instant(name: str, run_dir: str, rng: random.Random, max_delay: float, *args: str,
                           script: str = SCRIPT) -> bool:
    """Start the scenario (``script``, scenarios.py by default), wait until it trains, SIGKILL
    it after a random delay. Returns False if it finished before the kill."""
    with tempfile.TemporaryFile(mode="w+") as stderr:  # a file, so a chatty child never blocks on a pipe
        process = forkserver.popen([sys.executable, script, name, run_dir, *args], env=environment(None),
                                   stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            line = process.stdout.readline()
            if not line.startswith("training"):
                process.wait(TIMEOUT)
                stderr.seek(0)
                assert process.returncode == 0, stderr.read()[-3000:]
                return False
            time.sleep(rng.uniform(0.0, max_delay))
            process.send_signal(signal.SIGKILL)
            process.wait(TIMEOUT)
            return process.returncode == -signal.SIGKILL
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            process.stdout.close()


class AtSplit(engine.Callback):
    """Calls ``action(*arguments)`` once, at the end of the ``at``-th split this process runs
    (the run's own doings mid-training: a SIGTERM to itself, a newcomer taking the lease)."""

    def __init__(self, at, action, *arguments):
        self.at, self.action, self.arguments = at, action, arguments
        self.seen = 0

    def on_split_end(self, view):
        self.seen += 1
        if self.seen == self.at:
            self.action(*self.arguments)


def signals_to_self(*numbers):
    """Sends each signal of ``numbers`` to this process, in order."""
    for number in numbers:
        os.kill(os.getpid(), number)


def sigterm_to_self():
    signals_to_self(signal.SIGTERM)
