"""The training function tests/run/test_submitit.py submits through submitit's LocalExecutor:
the TBPTT scenario of scenarios.py with a checkpoint every 4 splits. Its first process, at split
``PREEMPT_AT``, writes its pid to ``<run_dir>.pid`` and waits for ``<run_dir>.signalled`` (the
test signals it in between, as submitit's controller does before a time limit), so the
preemption lands at a known boundary whatever the machine's load."""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any

import torch

import engine
from scenarios import train_with_checkpoints

PREEMPT_AT = 6
WAIT_SECONDS = 120


class WaitForTheSignal(engine.Callback):
    def __init__(self, run_dir: str) -> None:
        self.pid_file = pathlib.Path(f"{run_dir}.pid")
        self.signalled = pathlib.Path(f"{run_dir}.signalled")

    def on_split_end(self, view: engine.RunView) -> None:
        if view.optimizer_steps != PREEMPT_AT or self.pid_file.exists():
            return
        self.pid_file.write_text(str(os.getpid()))
        deadline = time.monotonic() + WAIT_SECONDS
        while not self.signalled.exists() and time.monotonic() < deadline:
            time.sleep(0.01)


def train(run_dir: str) -> dict[str, Any]:
    """Train (or resume) the scenario; what the job returns."""
    torch.set_num_threads(1)
    result = train_with_checkpoints("tbptt", run_dir, every=4, callbacks=(WaitForTheSignal(run_dir),))
    return {"resumed_from": result.resumed_from, "steps": result.optimizer_steps, "pid": os.getpid()}
