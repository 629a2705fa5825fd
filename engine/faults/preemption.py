"""Graceful preemption: a signal handler that only records the signal.

The run checks the record at each split boundary: it finishes the split in progress, commits a
checkpoint, flushes pending asynchronous writes, runs the optional requeue command and exits
with ``TrainerConfig.preemption_exit_code`` (see docs/preemption.md). Saving from inside the
handler would be unsafe: it can run in the middle of backward or of a checkpoint write. The
launcher (:mod:`engine.distributed.launch`) records its signals the same way.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Iterable

from engine.errors import warn as warn_user


class PreemptionWatcher:
    """Context manager that installs the handlers and restores the previous ones on exit."""

    def __init__(self, signals: Iterable[int]) -> None:
        self._signals = [int(number) for number in signals]
        self._previous: dict[int, Any] = {}
        self.received: int | None = None

    def __enter__(self) -> "PreemptionWatcher":
        if threading.current_thread() is not threading.main_thread():
            if self._signals:
                warn_user("fit runs outside the main thread: preemption signals are not handled")
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
