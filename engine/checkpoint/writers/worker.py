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
                job = self._take_locked()
                while job is None and not self._closing:
                    self._condition.wait()
                    job = self._take_locked()
                if job is None:
                    return
            try:
                self._run(job)
            except BaseException as error:  # reaches the training thread at its next boundary
                with self._condition:
                    if self._error is None:
                        self._error = error
            finally:
                self._after(job)
                with self._condition:
                    self.last_end = time.monotonic()  # before the busy mark drops: see the *_since readers
                    self._idle_locked()
                    self._condition.notify_all()

    def _take_error_locked(self) -> BaseException | None:
        error, self._error = self._error, None
        return error

    def _stop_thread(self) -> None:
        """Let the thread finish the queued jobs and end; wait for it."""
        with self._condition:
            self._closing = True
            self._condition.notify_all()
        self._thread.join()
