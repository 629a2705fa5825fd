"""For the tests of the tracker loggers (engine.loggers.MLflow, WandB): what metrics.jsonl says a
tracker's run must hold (each metric's points as (optimizer step, value), keyed as the
TensorBoard tags), and a kill that lands once the tracker holds some of the rows."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

import forkserver
from kill_helpers import TIMEOUT, environment
from resume_helpers import read_metrics

History = dict[str, list[tuple[int, float]]]


def expected_histories(run_dir: str) -> History:
    """The rows of ``run_dir``'s metrics.jsonl as metric histories: ``<stage>/<name>`` ->
    [(step, value), ...] in the rows' order."""
    expected: History = {}
    for line in read_metrics(run_dir).splitlines():
        row = json.loads(line)
        for name, value in [("loss", row.get("loss")), *row.get("metrics", {}).items()]:
            if value is not None:
                expected.setdefault(f"{row['stage']}/{name}", []).append((row["step"], value))
    return expected


def kill_once(script: str, run_dir: str, tracker: list[str], ready: Callable[[], bool]) -> None:
    """Start ``script schedule RUN_DIR --sleep 0.2 TRACKER...`` (tests/plateau_scenario.py) and
    SIGKILL it once ``ready()``; it must not have ended by then."""
    with tempfile.TemporaryFile(mode="w+") as stderr:
        process = forkserver.popen([sys.executable, script, "schedule", run_dir, "--sleep", "0.2", *tracker],
                                   env=environment(None), stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        try:
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline and process.poll() is None and not ready():
                time.sleep(0.1)
            process.send_signal(signal.SIGKILL)
            process.wait(TIMEOUT)
            stderr.seek(0)
            assert process.returncode == -signal.SIGKILL, "it ended before the kill: " + stderr.read()[-3000:]
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
