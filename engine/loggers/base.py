"""What a logger is, how the run drives it, and the checks of the paths loggers write to.

A logger receives the rows of ``metrics.jsonl`` (as dicts: ``stage``, ``epoch``, ``batch``,
``split``, ``step``, ``loss``, ``metrics``, ...), the same rows in the same order, on rank 0
only, as they are produced. Lines of ``metrics.jsonl`` reach the file only with a checkpoint's
commit; a logger's output runs ahead of it. So at each start the run tells every logger what the
file holds: :meth:`Logger.start_fresh` (nothing, a new run) or :meth:`Logger.resume` (the rows
the resumed checkpoint committed), and the logger makes its output agree with them before the
resumed run appends the rows that follow, exactly once.

Loggers that cannot take a point back (the experiment trackers: engine.loggers.MLflow, WandB)
send a row only once a checkpoint committed it: :meth:`Logger.committed` tells them how many rows
of ``metrics.jsonl`` are committed so far. :meth:`Logger.bind` hands them, before the start, the
run's files (where a tracker records its run id) and the run's hyperparameters.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterator, Mapping, Protocol, Sequence

from engine.errors import ConfigError, warn as warn_user

Row = dict[str, object]


class RunFiles(Protocol):
    """Small files in the run directory (the run's ``Storage`` is one)."""

    def exists(self, relative: str) -> bool: ...

    def read(self, relative: str, limit: int | None = None) -> bytes: ...

    def replace(self, relative: str, data: bytes) -> None: ...


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a logger is told about the run before it starts (:meth:`Logger.bind`).

    Attributes:
        files: the run directory's files (None without a ``run_dir``).
        hyperparameters: the run's settings as flat ``name -> text`` pairs (the TrainerConfig's
            fields as ``config/<field>``, the module's ``hparams`` as ``hparams/<name>``).
        export_weights: writes the model weights of the run's newest checkpoint into the local
            directory it is given and returns the file's path (``model.safetensors``, or
            ``model.pt`` without safetensors); None without checkpoints. Call it at ``close``:
            the run's last checkpoint is durable by then.
    """

    files: RunFiles | None = None
    hyperparameters: Mapping[str, str] = dataclasses.field(default_factory=dict)
    export_weights: Callable[[str], str] | None = None


class Logger:
    """Base of the metric loggers of ``TrainerConfig(loggers=[...])``. Subclass it to write
    rows somewhere else; every method has a no-op default.

    The run calls, on rank 0: ``bind(run)``, then ``start_fresh()`` or ``resume(rows, step)``
    once at the start; ``log_row(row)`` for each row of ``metrics.jsonl``; ``flush()`` whenever
    a checkpoint seals the rows so far; ``committed(count)`` once a checkpoint committed them
    (possibly from the checkpoint writer's thread); ``close()`` when ``fit`` ends (also on an
    error). An exception from any of them is a warning, never the end of the training.
    """

    def bind(self, run: RunInfo) -> None:
        """The run about to start (called before ``start_fresh`` or ``resume``)."""

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

    def committed(self, rows: int) -> None:
        """The first ``rows`` rows of ``metrics.jsonl`` (counted from the file's start, the
        resumed rows included) are committed: no resume will take them back. Without
        checkpoints every row is committed as it is logged."""

    def close(self) -> None:
        """``fit`` ends."""


class LoggerSet:
    """The loggers of one fit on rank 0: each call reaches every logger, and a logger that
    raises is named in a warning while the run trains on (a metric sink's failure is not worth
    a training run; ``metrics.jsonl`` and the checkpoints are the record)."""

    def __init__(self, loggers: Sequence[Logger], run: RunInfo | None = None) -> None:
        self._loggers = list(loggers)
        self._run = run if run is not None else RunInfo()

    def __bool__(self) -> bool:
        return bool(self._loggers)

    def start_fresh(self) -> None:
        for logger in self._loggers:
            self._call(logger, "start", lambda: logger.bind(self._run))
            self._call(logger, "start", logger.start_fresh)

    def resume(self, committed_rows: Sequence[Row], resumed_step: int) -> None:
        for logger in self._loggers:
            self._call(logger, "resume", lambda: logger.bind(self._run))
            self._call(logger, "resume", lambda: logger.resume(committed_rows, resumed_step))

    def log_row(self, row: Row) -> None:
        for logger in self._loggers:
            self._call(logger, "write a row", lambda: logger.log_row(row))

    def flush(self) -> None:
        for logger in self._loggers:
            self._call(logger, "flush", logger.flush)

    def committed(self, rows: int) -> None:
        for logger in self._loggers:
            self._call(logger, "take the committed rows", lambda: logger.committed(rows))

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


def row_step(row: Row) -> int:
    """The optimizer step a row of metrics.jsonl was logged at."""
    step = row.get("step")
    return step if isinstance(step, int) else 0


def row_scalars(row: Row) -> Iterator[tuple[str, float]]:
    """A row's values as ``(<stage>/<name>, value)``: ``<stage>/loss`` (``<stage>/loss_0``, ...
    with several optimizers) and ``<stage>/<metric>``."""
    stage = row.get("stage", "train")
    if "loss" in row and isinstance(row["loss"], (int, float)):
        yield f"{stage}/loss", float(row["loss"])
    losses = row.get("losses")
    if isinstance(losses, list):
        for index, value in enumerate(losses):
            yield f"{stage}/loss_{index}", float(value)
    metrics = row.get("metrics")
    if isinstance(metrics, dict):
        for name, value in metrics.items():
            yield f"{stage}/{name}", float(value)


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
