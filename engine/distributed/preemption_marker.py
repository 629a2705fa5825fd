"""Tell the launcher that a distributed run stopped for a preemption.

In a distributed job ``torchrun`` exits 1 when a worker fails and 0 when all succeed, whatever status they returned,
so a worker's exit status 75 cannot reach the scheduler (and a non-zero worker status would make
torchrun restart the group). Instead, under torchrun a preempted run's workers exit 0 and rank
0, after the preemption checkpoint has committed, writes a small JSON marker at the path
``SPLITLOOP_PREEMPTION_MARKER`` names. ``python -m engine launch -- torchrun ...`` sets that
variable, and turns a marker into its own exit status (75 by default).

The launcher also sets ``SPLITLOOP_LAUNCH_WORKERS``, a directory of its own: each worker entering
``fit`` registers there (its pid, and the signal that asks it to stop), and the launcher sends
that signal, once, to each registered worker when a preemption reaches it. See
docs/preemption.md.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Mapping, Sequence

from engine.distributed.environment import requested_world_size

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


def register_launched_worker(preemption_signals: Sequence[int]) -> None:
    """Under ``python -m engine launch``, tell the launcher that this process is a worker in
    ``fit`` with handlers for ``preemption_signals`` installed, and which one to send it: a file
    named by the pid, holding the signal number, in the launch's own directory. Nothing without
    a launcher, without such signals, or outside the main thread (no handler is installed)."""
    directory = os.environ.get(WORKERS_VARIABLE)
    if not directory or not preemption_signals or threading.current_thread() is not threading.main_thread():
        return
    try:
        with open(os.path.join(directory, str(os.getpid())), "w", encoding="utf-8") as handle:
            handle.write(str(int(preemption_signals[0])))
    except FileNotFoundError:
        pass  # the launcher has gone: nobody is listening


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
