"""What a logger is, how the run drives it, and the checks of the paths loggers write to.

A logger receives the rows of ``metrics.jsonl`` (as dicts: ``stage``, ``epoch``, ``batch``,
``split``, ``step``, ``loss``, ``metrics``, ...), the same rows in the same order, on rank 0
only, as they are produced. Lines of ``metrics.jsonl`` reach the file only with a checkpoint's
commit; a logger's output runs ahead of it. So at each start the run tells every logger what the
file holds: :meth:`Logger.start_fresh` (nothing, a new run) or :meth:`Logger.resume` (the rows
the resumed checkpoint committed), and the logger makes its output agree with them before the
resumed run appends the rows that follow, exactly once.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

from engine.errors import ConfigError, warn as warn_user

Row = dict[str, object]


class Logger:
    """Base of the metric loggers of ``TrainerConfig(loggers=[...])``. Subclass it to write
    rows somewhere else; every method has a no-op default.

    The run calls, on rank 0: ``start_fresh()`` or ``resume(rows, step)`` once at the start;
    ``log_row(row)`` for each row of ``metrics.jsonl``; ``flush()`` whenever a checkpoint
    seals the rows so far; ``close()`` when ``fit`` ends (also on an error). An exception
    from any of them is a warning, never the end of the training.
    """

    def start_fresh(self) -> None:
        """A new run: drop whatever an earlier run left where this logger writes."""

    def resume(self, committed_rows: Sequence[Row], resumed_step: int) -> None:
        """A resumed run: ``committed_rows`` are the rows of ``metrics.jsonl`` the checkpoint
        committed (in order); ``resumed_step`` its optimizer step count. Rows logged after the
        checkpoint by the interrupted process come again from the resumed one."""

    def log_row(self, row: Row) -> None:
        """One row of ``metrics.jsonl`` (shared with the other loggers: read it, do not change it)."""

    def flush(self) -> None:
        """Make what was logged so far durable (a checkpoint is being taken)."""

    def close(self) -> None:
        """``fit`` ends."""


class LoggerSet:
    """The loggers of one fit on rank 0: each call reaches every logger, and a logger that
    raises is named in a warning while the run trains on (a metric sink's failure is not worth
    a training run; ``metrics.jsonl`` and the checkpoints are the record)."""

    def __init__(self, loggers: Sequence[Logger]) -> None:
        self._loggers = list(loggers)

    def __bool__(self) -> bool:
        return bool(self._loggers)

    def start_fresh(self) -> None:
        for logger in self._loggers:
            self._call(logger, "start", logger.start_fresh)

    def resume(self, committed_rows: Sequence[Row], resumed_step: int) -> None:
        for logger in self._loggers:
            self._call(logger, "resume", lambda: logger.resume(committed_rows, resumed_step))

    def log_row(self, row: Row) -> None:
        for logger in self._loggers:
            self._call(logger, "write a row", lambda: logger.log_row(row))

    def flush(self) -> None:
        for logger in self._loggers:
            self._call(logger, "flush", logger.flush)

    def close(self) -> None:
        for logger in self._loggers:
            self._call(logger, "close", logger.close)

    @staticmethod
    def _call(logger: Logger, action: str, call: Callable[[], object]) -> None:
        try:
            call()
        except Exception as error:  # noqa: BLE001 - any failure of a logger only warns
            warn_user(f"{logger!r} could not {action}: {type(error).__name__}: {error}; training goes on "
                      "(metrics.jsonl keeps every row)")


def local_path(owner: str, field: str, value: object) -> str:
    """``value`` as a local filesystem path, or ConfigError naming ``owner.field``: a non-empty
    string or ``os.PathLike``, without control characters, not a URL (loggers write local files)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{owner}.{field}: expected a non-empty local path (str or os.PathLike), got {value!r}")
    if any(ord(character) < 32 or ord(character) == 127 for character in value):
        raise ConfigError(f"{owner}.{field}: {value!r} contains a control character (a NUL, newline or tab?)")
    if "://" in value:
        raise ConfigError(f"{owner}.{field}: {value!r} is a URL; the logger writes local files, give a local path")
    return value


def refuse_existing(owner: str, field: str, path: str, must_be_directory: bool) -> None:
    """ConfigError when ``path`` exists as the wrong kind (a file where a directory goes, or the
    reverse), or when a parent of it is a file."""
    if os.path.exists(path) and os.path.isdir(path) != must_be_directory:
        expected, found = ("a directory", "a file") if must_be_directory else ("a file", "a directory")
        raise ConfigError(f"{owner}.{field}: {path!r} is {found}, expected {expected} path")
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent) if os.path.dirname(parent) != parent else ""
    if parent and not os.path.isdir(parent):
        raise ConfigError(f"{owner}.{field}: {path!r} lies under {parent!r}, which is a file, not a directory")
