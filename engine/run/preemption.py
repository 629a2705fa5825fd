"""Preemption helpers of a run: a loader whose workers outlive the preemption signals, the
stop reason (naming the signal that arrived, also when something passed it on as another), and
the requeue command. The signal handler itself is :class:`engine.faults.preemption.PreemptionWatcher`;
what a run does on a preemption is in docs/preemption.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import warnings
from typing import Any, Iterable, Sequence

from engine.config import TrainerConfig
from engine.data.workers import PreemptionSafeLoader
from engine.distributed.preemption_marker import launch_request

# delivered signal -> the signal that arrived, while something in this process passes one on
# as the other (engine.submitit turns submitit's SIGUSR2 into SIGTERM)
_passed_on: dict[int, int] = {}


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


def pass_on(arrived: int, delivered: int) -> None:
    """Send this process ``delivered`` for ``arrived`` (from a signal handler): the stop reason
    of the run names ``arrived``, until :func:`forget_passed_on`."""
    _passed_on[int(delivered)] = int(arrived)
    os.kill(os.getpid(), delivered)


def forget_passed_on() -> None:
    """The signals this process sends itself from now on stand for themselves."""
    _passed_on.clear()


def preemption_reason(received: int) -> str:
    """``"preempted by SIGUSR1"``: the stop reason of a run whose preemption handler recorded
    ``received``, naming the signal that arrived: the launcher's (python -m engine launch sends
    its workers their own signal) or the one passed on in this process (:func:`pass_on`)."""
    arrived = _passed_on.get(received) or launch_request(received) or received
    return f"preempted by {signal.Signals(arrived).name}"


def run_requeue_command(command: str) -> None:
    """Run the user's requeue command (for example ``scontrol requeue $SLURM_JOB_ID``)."""
    try:
        completed = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        warnings.warn(f"requeue command {command!r} failed: {error}", stacklevel=2)
        return
    if completed.returncode != 0:
        warnings.warn(f"requeue command {command!r} exited with {completed.returncode}: {completed.stderr.strip()[-500:]}", stacklevel=2)
