"""The training function tests/run/test_submitit.py submits through submitit's LocalExecutor:
the TBPTT scenario of scenarios.py with a checkpoint every 4 splits. Its first process, at the
``phase`` it is given (``"split"``: at split ``PREEMPT_AT`` of fit; ``"before fit"``: where a
script loads its data and builds its model; ``"after fit"``: once fit returned), writes its pid
to ``<run_dir>.pid`` and waits for ``<run_dir>.signalled`` (the test signals it in between, as
submitit's controller does before a time limit), so the preemption lands at a known point
whatever the machine's load."""

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


PHASES = ("split", "before fit", "after fit")


def wait_for_the_signal(run_dir: str) -> None:
    """In the job's first process only: say where it is, and wait until the test signalled it."""
    pid_file, signalled = pathlib.Path(f"{run_dir}.pid"), pathlib.Path(f"{run_dir}.signalled")
    if pid_file.exists():
        return
    pathlib.Path(f"{pid_file}.tmp").write_text(str(os.getpid()))
    os.replace(f"{pid_file}.tmp", pid_file)  # whole: the test reads it as soon as it exists
    deadline = time.monotonic() + WAIT_SECONDS
    while not signalled.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class WaitForTheSignal(engine.Callback):
    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def on_split_end(self, view: engine.RunView) -> None:
        if view.optimizer_steps == PREEMPT_AT:
            wait_for_the_signal(self.run_dir)


def train(run_dir: str, phase: str = "split") -> dict[str, Any]:
    """Train (or resume) the scenario; what the job returns."""
    torch.set_num_threads(1)
    if phase == "before fit":
        wait_for_the_signal(run_dir)
    callbacks = (WaitForTheSignal(run_dir),) if phase == "split" else ()
    result = train_with_checkpoints("tbptt", run_dir, every=4, callbacks=callbacks)
    if phase == "after fit":
        wait_for_the_signal(run_dir)
    return {"resumed_from": result.resumed_from, "steps": result.optimizer_steps, "pid": os.getpid()}
