"""``python -m engine launch --requeue [--signal NAME]``: after a committed preemption, or after
a hang (exit 86), put the SLURM job back in the queue (``scontrol requeue $SLURM_JOB_ID``) from
the launcher itself; never after a crash loop (exit 87).

``--signal`` names the scheduler's warning signal (SLURM's ``--signal=B:USR1@120`` sends
SIGUSR1): only a preemption that signal requested is requeued, so a ``scancel`` (SIGTERM)
still commits and exits 75 but is not put back in the queue. Without ``--signal`` every
committed preemption is requeued. Without ``scontrol`` on ``PATH`` or ``SLURM_JOB_ID`` the
launcher says so and exits 75 as without ``--requeue`` (a wrapper can requeue on that status).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys

from engine.errors import ConfigError

SCONTROL_TIMEOUT_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class RequeuePolicy:
    """``signals``: the signals whose preemption is requeued (empty: any)."""

    signals: frozenset[int] = frozenset()

    def applies_to(self, received: int | None, reason: str | None) -> bool:
        """Whether a preemption requested by ``received`` (the launcher's signal; None when
        only the workers got one, then the run's ``reason`` names it) is requeued."""
        if not self.signals:
            return True
        if received is not None:
            return received in self.signals
        return any(reason is not None and reason.endswith(signal.Signals(number).name) for number in self.signals)

    def describe(self) -> str:
        return " or ".join(sorted(signal.Signals(number).name for number in self.signals)) or "any signal"


def parse_signal(name: str) -> int:
    """``USR1``, ``SIGUSR1`` or ``10`` -> the signal number; ConfigError for anything else."""
    text = name.strip().upper()
    try:
        number = int(text) if text.isdigit() else int(getattr(signal, text if text.startswith("SIG") else f"SIG{text}"))
        return int(signal.Signals(number))
    except (AttributeError, ValueError) as error:
        raise ConfigError(f"launch --signal: {name!r} is not a signal name (USR1, SIGUSR1, TERM) or number") from error


def requeue_after_preemption(policy: RequeuePolicy, received: int | None, reason: str | None) -> None:
    """Run ``scontrol requeue $SLURM_JOB_ID`` when ``policy`` applies; one line on stderr says
    what happened. Never raises: the preemption is committed, the exit status stays 75."""
    if not policy.applies_to(received, reason):
        _say(f"the preemption came by {_name(received, reason)}, not --signal {policy.describe()}: not requeued")
        return
    _scontrol_requeue()


def requeue_after_hang() -> None:
    """After a hang (exit 86) the job is requeued whatever --signal says: it came by no signal.
    Never raises."""
    _scontrol_requeue()


def _scontrol_requeue() -> None:
    job = os.environ.get("SLURM_JOB_ID")
    scontrol = shutil.which("scontrol")
    if not job or scontrol is None:
        missing = "SLURM_JOB_ID is not set" if not job else "scontrol is not on PATH"
        _say(f"--requeue: {missing}; not requeued (the exit status tells the scheduler to requeue)")
        return
    try:
        done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_SECONDS, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        _say(f"--requeue: scontrol requeue {job} failed: {error}")
        return
    if done.returncode != 0:
        _say(f"--requeue: scontrol requeue {job} exited with {done.returncode}: {done.stderr.strip()[-500:]}")
        return
    _say(f"requeued job {job} (scontrol requeue {job})")


def _name(received: int | None, reason: str | None) -> str:
    return signal.Signals(received).name if received is not None else (reason or "an unknown signal")


def _say(text: str) -> None:
    print(f"splitloop launch: {text}", file=sys.stderr, flush=True)
