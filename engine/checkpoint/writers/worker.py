"""The daemon thread behind a checkpoint writer that runs beside training (the background
writer, engine.checkpoint.writers.writer; the copies into the durable tier, engine.checkpoint.tiers.fast):
jobs taken one at a time under one condition, the first error kept for the training thread,
and when the last job ended (to tell whether a split overlapped one)."""

from __future__ import annotations

import math
import threading
import time
from typing import Callable, Generic, TypeVar

Job = TypeVar("Job")
# Whether background checkpoint work ran at any moment after a time.monotonic() reading.
BackgroundWork = Callable[[float], bool]


class BackgroundWorker(Generic[Job]):
    """Runs :meth:`_run` for each job :meth:`_take_locked` hands out, in a daemon thread, from
    :meth:`_start_thread` until :meth:`_stop_thread`. A subclass keeps its queue under ``self._condition``, marks itself busy
    in :meth:`_take_locked` and idle in :meth:`_idle_locked`; an error a job raises is kept (the
    first one) for :meth:`_take_error_locked` on the training thread."""

    # When the last job ended (time.monotonic()); -inf before the first.
    last_end = -math.inf

    def __init__(self, condition: threading.Condition, thread_name: str) -> None:
        self._condition = condition
        self._closing = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name=thread_name, daemon=True)

    def _start_thread(self) -> None:
        """Start the thread (once the subclass's own state is set up)."""
        self._thread.start()

    def _take_locked(self) -> Job | None:
        """The next job, marked as running; None when none is queued."""
        raise NotImplementedError

    def _run(self, job: Job) -> None:
        raise NotImplementedError

    def _after(self, job: Job) -> None:
        """Called (without the lock) once ``job`` ended, however it ended."""

    def _idle_locked(self) -> None:
        """Clear the mark :meth:`_take_locked` set."""
        raise NotImplementedError

    def _work(self) -> None:
        while True:
            with self._condition:
                if not self._is_current_thread():
                    return
                job = self._take_locked()
                while job is None and not self._closing:
                    self._condition.wait()
                    job = self._take_locked()
                if job is None:
                    return
            error: BaseException | None = None
            try:
                self._run(job)
            except BaseException as raised:  # reaches the training thread at its next boundary
                error = raised
            with self._condition:  # (re-entrant: _after may take it again)
                if not self._is_current_thread():
                    return  # abandoned while it ran (see _replace_thread): nothing of it counts
                if error is not None and self._error is None:
                    self._error = error
                try:
                    self._after(job)
                finally:
                    self.last_end = time.monotonic()  # before the busy mark drops: see the *_since readers
                    self._idle_locked()
                    self._condition.notify_all()

    def _is_current_thread(self) -> bool:
        """Whether the calling thread is this worker's thread (False in one it abandoned)."""
        return threading.current_thread() is self._thread

    def _replace_thread(self) -> None:
        """Abandon the thread (stuck in a job that never returns: a storage write) and start a
        new one for the jobs still queued; call with the condition held, after the job's own
        bookkeeping. The old thread, should it ever return, takes no job, keeps no error and
        touches nothing (:meth:`_is_current_thread`); the job itself must fence its own effects
        (engine.checkpoint.writers.writer.BackgroundWriter checks it in its fence)."""
        self._idle_locked()
        self._thread = threading.Thread(target=self._work, name=self._thread.name, daemon=True)
        self._thread.start()

    def _take_error_locked(self) -> BaseException | None:
        error, self._error = self._error, None
        return error

    def _stop_thread(self) -> None:
        """Let the thread finish the queued jobs and end; wait for it."""
        with self._condition:
            self._closing = True
            self._condition.notify_all()
        self._thread.join()
