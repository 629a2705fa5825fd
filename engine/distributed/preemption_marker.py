"""Tell the launcher that a distributed run stopped for a preemption.

In a distributed job ``torchrun`` exits 1 when a worker fails and 0 when all succeed, whatever status they returned,
so a worker's exit status 75 cannot reach the scheduler (and a non-zero worker status would make
torchrun restart the group). Instead, under torchrun a preempted run's workers exit 0 and rank
0, after the preemption checkpoint has committed, writes a small JSON marker at the path
``SPLITLOOP_PREEMPTION_MARKER`` names. ``python -m engine launch -- torchrun ...`` sets that
variable, and turns a marker into its own exit status (75 by default).

The launcher also sets ``SPLITLOOP_LAUNCH_WORKERS``, a directory of its own: each worker entering
``fit`` registers there (its pid, and the signal that asks it to stop), and the launcher sends
that signal, once, to each registered worker when a preemption reaches it, after writing which
signal reached it (the workers' stop reason names that one, not the one they were sent).

A registered worker is also tied to its torchrun: the kernel sends it the same signal when
torchrun dies (torch starts its workers in sessions of their own and leaves them running when it
is killed; the launcher has torchrun SIGKILLed when the launcher itself dies). A worker that
enters fit after the launcher died (its lock is free) stops at its first boundary. So no worker
trains on unsupervised: it commits and ends. See docs/preemption.md.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import threading
import time
from typing import Mapping, Sequence

from engine.distributed import _prctl
from engine.distributed.variables import requested_world_size

MARKER_VARIABLE = "SPLITLOOP_PREEMPTION_MARKER"


def distributed_torchrun_worker(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a torchrun worker whose preemption the marker carries: one of a
    job of several processes, or of any job under ``python -m engine launch`` (a job of one
    without the launcher keeps the single-process behaviour: exit 75, and torchrun starts it
    again; under the launcher that restart would train on after the stop request)."""
    environ = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in environ and (requested_world_size(environ) > 1 or MARKER_VARIABLE in environ)


def write_preemption_marker(reason: str | None, checkpoint: str | None) -> None:
    """Record (atomically) that the run stopped for a preemption after committing ``checkpoint``;
    nothing when no launcher asked for a marker."""
    path = os.environ.get(MARKER_VARIABLE)
    if not path:
        return
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump({"reason": reason, "checkpoint": checkpoint, "time_unix": time.time()}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def committed_preemption() -> dict[str, object] | None:
    """The marker's record when this launch has already committed a preemption checkpoint and
    this torchrun worker was started after it (torchrun restarts the whole group when one worker
    fails, even after the commit); None otherwise. Such a worker must not train: it would resume
    the preemption checkpoint, be asked to stop, and commit again."""
    path = os.environ.get(MARKER_VARIABLE)
    if not path or not distributed_torchrun_worker():
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None  # no marker (the launcher removes an earlier launch's), or one being replaced
    return record if isinstance(record, dict) else {}


def preempted_exit_status(configured: int) -> int:
    """The status a preempted worker exits with: ``configured``, except 0 for a worker of a
    distributed torchrun job (the marker carries the preemption to ``python -m engine launch``)."""
    return 0 if distributed_torchrun_worker() else configured


WORKERS_VARIABLE = "SPLITLOOP_LAUNCH_WORKERS"


# Files of the launch's workers directory besides the workers' own (named by their pid).
LAUNCHER_LOCK = "launcher.lock"  # held by the launcher while it runs
LAUNCH_REQUEST = "request"  # the signal that reached the launcher, once it asked the workers to stop
_registered_signal: int | None = None


def register_launched_worker(preemption_signals: Sequence[int]) -> None:
    """Under ``python -m engine launch``, tell the launcher that this process is a worker in
    ``fit`` with handlers for ``preemption_signals`` installed, and which one to send it: a file
    named by the pid, holding the signal number, in the launch's own directory. The same signal
    comes from the kernel when torchrun dies, and at once when the launcher has already gone
    (module docstring). Nothing without a launcher, without such signals, or outside the main
    thread (no handler is installed)."""
    global _registered_signal
    directory = os.environ.get(WORKERS_VARIABLE)
    if not directory or not preemption_signals or threading.current_thread() is not threading.main_thread():
        return
    number = int(preemption_signals[0])
    try:
        with open(os.path.join(directory, str(os.getpid())), "w", encoding="utf-8") as handle:
            handle.write(str(number))
    except FileNotFoundError:
        pass  # the launcher has gone and removed its directory: nobody is listening
    _registered_signal = number
    _prctl.set_parent_death_signal(number)
    if not _launcher_alive(directory):
        sys.stderr.write("splitloop: the launcher (python -m engine launch) has gone: this worker stops at its "
                         "first boundary instead of training unsupervised\n")
        os.kill(os.getpid(), number)


def _launcher_alive(directory: str) -> bool:
    """Whether the launcher still holds its lock (the kernel drops it when the launcher dies)."""
    try:
        descriptor = os.open(os.path.join(directory, LAUNCHER_LOCK), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)
    return False


def record_launch_request(directory: str, number: int) -> None:
    """The launcher's side: record (atomically) that ``number`` reached it, before it asks the
    workers registered in ``directory`` to stop."""
    temporary = os.path.join(directory, f"{LAUNCH_REQUEST}.tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(str(int(number)))
    os.replace(temporary, os.path.join(directory, LAUNCH_REQUEST))


def launch_request(received: int) -> int | None:
    """The signal that reached the launcher when ``received`` is the one this worker registered
    and the launcher asked the workers to stop; None otherwise (the signal came from elsewhere)."""
    directory = os.environ.get(WORKERS_VARIABLE)
    if not directory or received != _registered_signal:
        return None
    try:
        with open(os.path.join(directory, LAUNCH_REQUEST), encoding="utf-8") as handle:
            return int(signal.Signals(int(handle.read())))
    except (OSError, ValueError):
        return None


def registered_workers(directory: str) -> dict[int, int]:
    """pid -> the signal that asks it to stop, for each worker registered in ``directory``."""
    workers: dict[int, int] = {}
    try:
        names = [name for name in os.listdir(directory) if name.isdigit()]
    except FileNotFoundError:
        return workers
    for name in names:
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as handle:
                workers[int(name)] = int(handle.read())
        except (OSError, ValueError):
            continue  # being written: read at the next poll
    return workers
