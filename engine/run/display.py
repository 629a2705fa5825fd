"""Progress display: a one-line bar on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from progress import Cursor


class Display:
    """Shows epoch / batch / split, the last loss and the optimizer-step count, throttled."""

    def __init__(self, mode: str, log_every_seconds: float, total_batches: int | None, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self._stream.isatty() else "log"
        self._mode = mode
        self._interval = 0.1 if mode == "bar" else log_every_seconds
        self._total_batches = total_batches
        self._next_time = 0.0
        self._splits = 0

    def update(self, cursor: Cursor, loss: float, optimizer_steps: int) -> None:
        self._splits += 1
        if self._mode == "off":
            return
        now = time.monotonic()
        if now < self._next_time:
            return
        self._next_time = now + self._interval
        self._show(cursor, loss, optimizer_steps)

    def _show(self, cursor: Cursor, loss: float, optimizer_steps: int) -> None:
        batches = f"{cursor.batch + 1}/{self._total_batches}" if self._total_batches else f"{cursor.batch + 1}"
        text = f"epoch {cursor.epoch} batch {batches} split {cursor.split} loss {loss:.4f} steps {optimizer_steps}"
        if self._mode == "bar":
            self._stream.write("\r" + text.ljust(78))
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def close(self) -> None:
        if self._mode == "bar" and self._splits:
            self._stream.write("\n")
            self._stream.flush()
