"""Graceful preemption: a signal handler that only records the signal.

The run checks the record at each split boundary: it finishes the split in progress, commits a
checkpoint, flushes pending asynchronous writes, runs the optional requeue command and exits
with ``TrainerConfig.preemption_exit_code`` (see docs/preemption.md). Saving from inside the
handler would be unsafe: it can run in the middle of backward or of a checkpoint write.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import warnings
from types import FrameType
from typing import Any, Iterable, Sequence

from engine.config import TrainerConfig
from engine.data.workers import PreemptionSafeLoader


class PreemptionWatcher:
    """Context manager that installs the handlers and restores the previous ones on exit."""

    def __init__(self, signals: Iterable[int]) -> None:
        self._signals = [int(number) for number in signals]
        self._previous: dict[int, Any] = {}
        self.received: int | None = None

    def __enter__(self) -> "PreemptionWatcher":
        if threading.current_thread() is not threading.main_thread():
            if self._signals:
                warnings.warn("fit runs outside the main thread: preemption signals are not handled", stacklevel=3)
            return self
        for number in self._signals:
            self._previous[number] = signal.signal(number, self._record)
        return self

    def _record(self, number: int, frame: FrameType | None) -> None:
        # Only remember the first signal; a second one while saving changes nothing.
        if self.received is None:
            self.received = number

    def __exit__(self, *exc_info: object) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()

    @property
    def reason(self) -> str:
        return f"preempted by {signal.Signals(self.received).name}" if self.received is not None else ""


def preemption_safe(loader: Iterable[Any], signals: Sequence[int] | None = None) -> PreemptionSafeLoader:
    """``loader`` wrapped so that its DataLoader worker processes ignore the preemption signals.

    The engine does this itself for the training and validation data. Wrap a loader with
    ``num_workers > 0`` that your own code iterates during ``fit`` (in a callback, say): a
    SIGTERM sent to the process group would otherwise kill its workers, and the run would fail
    instead of committing its preemption checkpoint. Its ``close()`` stops the workers at once;
    otherwise they are stopped when it is garbage collected or the process exits.

    Args:
        loader: any iterable; a DataLoader with worker processes is iterated through a private
            copy, anything else as given.
        signals: the preemption signals; ``None`` means ``TrainerConfig``'s default
            (SIGTERM, SIGUSR1). Pass ``config.preemption_signals`` if you changed them.

    Example::

        probe = engine.preemption_safe(DataLoader(probe_set, batch_size=64, num_workers=4))
        for batch in probe:
            ...
    """
    return PreemptionSafeLoader(loader, TrainerConfig.preemption_signals if signals is None else signals)


def run_requeue_command(command: str) -> None:
    """Run the user's requeue command (for example ``scontrol requeue $SLURM_JOB_ID``)."""
    try:
        completed = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        warnings.warn(f"requeue command {command!r} failed: {error}", stacklevel=2)
        return
    if completed.returncode != 0:
        warnings.warn(f"requeue command {command!r} exited with {completed.returncode}: {completed.stderr.strip()[-500:]}", stacklevel=2)
