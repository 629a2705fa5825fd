"""One switch that runs the kill and preemption tests with their checkpoints written by a
writer process (``CheckpointConfig(writer="process")``, docs/guarantees.md
"A writer process")::

    SPLITLOOP_TEST_WRITER=process .venv/bin/python -m pytest -n 0 tests/run/test_kill.py

Every training script and helper of the single-process kill / preemption tests builds its
``TrainerConfig`` with :func:`trainer_config` (scenarios.py, rollback_scenario.py,
plateau_scenario.py, validation_scenarios.py, worker_training.py,
validated_worker_training.py, data/stream_train.py, lightning/lit_scenarios.py); the variable
reaches the processes they start through their environment. A configuration the writer process
refuses keeps its own writer: no checkpoints, a fast tier (``local_tier``), a run dir that is not
a local path (``memory://``, ``objectdir://``, ``s3://``) and torchrun (``WORLD_SIZE`` > 1).
The uninterrupted references the tests compare with run under the switch too; exact resume
makes a run the same whichever writer wrote its checkpoints.

A test that runs with a writer process by default whatever the switch says takes the
``test_writer`` fixture (tests/conftest.py) with ``indirect=True``: ``kill_helpers.WITH_A_WRITER_PROCESS``.

Not an engine setting: the engine reads no such variable.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import engine

VARIABLE = "SPLITLOOP_TEST_WRITER"
WRITERS = ("thread", "process")


def requested_writer() -> str | None:
    """The writer the switch asks for, None when it is unset."""
    value = os.environ.get(VARIABLE, "")
    if value and value not in WRITERS:
        raise ValueError(f"{VARIABLE}={value!r}: expected one of {', '.join(WRITERS)} (or unset)")
    return value or None


def trainer_config(**settings: Any) -> engine.TrainerConfig:
    """``engine.TrainerConfig(**settings)``, with the writer the switch asks for where the run allows it."""
    return with_requested_writer(engine.TrainerConfig(**settings))


def with_requested_writer(config: engine.TrainerConfig) -> engine.TrainerConfig:
    """``config`` with its checkpoints written by the requested writer, where it allows one."""
    writer = requested_writer()
    checkpoint = config.checkpoint
    if writer is None or checkpoint is None or not writer_process_allowed(config):
        return config
    checkpoint = dataclasses.replace(checkpoint, writer=writer)
    return dataclasses.replace(config, checkpoint=checkpoint)


def writer_process_allowed(config: engine.TrainerConfig) -> bool:
    """Whether the engine accepts a writer process for ``config`` (see the module docstring)."""
    run_dir = config.run_dir
    local = isinstance(run_dir, str) and "://" not in run_dir and "::" not in run_dir
    single_process = int(os.environ.get("WORLD_SIZE", "1")) == 1
    return local and single_process and config.checkpoint is not None and config.checkpoint.local_tier is None
