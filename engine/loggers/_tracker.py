"""What the experiment-tracker loggers (engine.loggers.MLflow, WandB) share.

A tracker cannot take a point back, so a row is sent only once a checkpoint committed it
(:meth:`Logger.committed`); no resume will log it again. A sender thread does the sending, so a
slow or unreachable tracker never holds the training up: the first failure is one warning, the
committed rows are kept and sent when the tracker answers again, and whatever is still unsent
when ``fit`` ends (after ``close_timeout`` seconds of trying) is listed in a warning.

On resume the tracker is asked how many points of each key it already holds; since rows are sent
in order, those are the first of that key's points among the committed rows, and only the
others are sent. Every committed row reaches the tracker once, whatever was killed when.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
import threading
import time
from typing import Callable, NamedTuple, Sequence

from engine.errors import ConfigError, warn as warn_user
from engine.loggers.base import Logger, Row, RunInfo, row_scalars, row_step



class Point(NamedTuple):
    """One row as a tracker takes it."""

    step: int                  # the row's optimizer step
    values: dict[str, float]   # "<stage>/<name>" -> value
    milliseconds: int          # when first sent (0 before); fixed, so a send tried again is the same send
    row: int                   # its row number in metrics.jsonl (from 0, counted from the file's start)


class Tracker(Logger):
    """Base of the tracker loggers: subclasses say how to reach their tracker
    (:meth:`_connect`, :meth:`_held_counts` or :meth:`_missing`, :meth:`_send`, :meth:`_finish`);
    this class decides what is sent and when (see the module docstring)."""

    def __init__(self, close_timeout: float, retry_seconds: float, log_model: bool = False) -> None:
        if not isinstance(log_model, bool):
            raise ConfigError(f"{type(self).__name__}.log_model: expected True or False, got {log_model!r}")
        self.log_model = log_model
        self.close_timeout = _positive(type(self).__name__, "close_timeout", close_timeout)
        self.retry_seconds = _positive(type(self).__name__, "retry_seconds", retry_seconds)
        self.run = RunInfo()
        self._condition = threading.Condition()
        self._points: list[Point] = []   # rows received and not yet sent; [0] is row number _first
        self._first = 0                  # rows of metrics.jsonl before _points[0] (sent, or resumed)
        self._committed = 0              # rows of metrics.jsonl committed
        self._backlog: list[Point] = []  # committed rows of an earlier process the tracker lacks
        self._closing = False
        self._give_up_at = float("inf")
        self._thread: threading.Thread | None = None
        self._down = False               # the tracker did not answer (warned once)
        self._notices: list[str] = []    # warnings from the sender thread, raised on the training thread
        self.unsent: list[Point] = []    # committed rows that never reached the tracker (after close)
        self._last_milliseconds = 0
        self._model_sent = False

    # ---- the Logger interface (training thread; committed() also the writer's) -------------
    def bind(self, run: RunInfo) -> None:
        self.run = run

    def start_fresh(self) -> None:
        self._start(None)

    def resume(self, committed_rows: Sequence[Row], resumed_step: int) -> None:
        self._start(list(committed_rows))

    def log_row(self, row: Row) -> None:
        with self._condition:
            self._points.append(Point(row_step(row), dict(row_scalars(row)), 0, self._first + len(self._points)))
        self._raise_notices()

    def committed(self, rows: int) -> None:
        with self._condition:
            if rows > self._committed:
                self._committed = rows
                self._condition.notify_all()

    def close(self) -> None:
        self._stop()
        self._raise_notices()
        if self.unsent:
            steps = [point.step for point in self.unsent]
            warn_user(f"{self!r}: {len(self.unsent)} committed rows (steps {min(steps)} to {max(steps)}) did not "
                      f"reach the tracker within close_timeout={self.close_timeout:g} s; metrics.jsonl keeps them, "
                      "and the next resume of this run sends them")

    # ---- what a subclass implements (sender thread) ---------------------------------------
    def _connect(self, fresh: bool) -> None:
        """Create the tracker run (``fresh``) or attach to the one recorded in the run directory."""
        raise NotImplementedError

    def _held_counts(self) -> dict[str, int]:
        """How many points of each key the attached tracker run holds."""
        raise NotImplementedError

    def _missing(self, committed_rows: list[Row]) -> tuple[list[Point], dict[str, int]]:
        """The points of ``committed_rows`` the attached run lacks, and what it holds beyond them
        (by default from :meth:`_held_counts`; see :func:`points_missing`)."""
        return points_missing(committed_rows, self._held_counts())

    def _send(self, points: list[Point]) -> None:
        """Send ``points`` (in order) to the attached run."""
        raise NotImplementedError

    def _finish(self) -> None:
        """Everything committed was sent and ``fit`` ends."""

    def _send_model(self, path: str) -> None:
        """Log the weights file ``path`` as the run's model (``log_model=True``)."""
        raise NotImplementedError

    def _reset(self) -> None:
        """A new start (no sender thread runs): forget the previous start's connection."""

    # ---- the sender thread ------------------------------------------------------------------
    def _start(self, committed_rows: list[Row] | None) -> None:
        self._stop()  # a rollback resumes a running logger: its sender ends first
        self._reset()
        with self._condition:
            self._points, self._backlog, self.unsent = [], [], []
            self._first = self._committed = 0 if committed_rows is None else len(committed_rows)
            self._closing, self._give_up_at, self._down = False, float("inf"), False
            self._model_sent = False
        self._thread = threading.Thread(target=self._work, args=(committed_rows,), daemon=True,
                                        name=f"splitloop {type(self).__name__} sender")
        self._thread.start()

    def _stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        with self._condition:
            self._closing = True
            self._give_up_at = time.monotonic() + self.close_timeout
            self._condition.notify_all()
        thread.join(self.close_timeout + 1.0)
        with self._condition:
            self.unsent = self._backlog + self._points[:self._committed - self._first]

    def _work(self, committed_rows: list[Row] | None) -> None:
        if not self._until_done(lambda: self._connect(committed_rows is None)):
            return
        if committed_rows is not None:
            found: list[tuple[list[Point], dict[str, int]]] = []
            if not self._until_done(lambda: found.append(self._missing(committed_rows))):
                return
            with self._condition:
                self._backlog, extra = found[0]
            if extra:
                self._notice(f"{self!r}: the tracker run holds points beyond the resumed checkpoint ({extra}); "
                             "a newer checkpoint was lost after its rows were sent, and they stay in the tracker")
        while self._send_next():
            pass
        self._until_done(self._end)

    def _end(self) -> None:
        """``fit`` ends and every committed row was sent: the model (``log_model``), then the end."""
        if self.log_model and self.run.export_weights is not None and not self._model_sent:
            with tempfile.TemporaryDirectory(prefix="splitloop-model-") as directory:
                try:
                    path = self.run.export_weights(directory)
                except Exception as error:  # noqa: BLE001 - no checkpoint to export: the rest still ends
                    self._notice(f"{self!r}: log_model: the weights could not be exported ({type(error).__name__}: "
                                 f"{error}); no model is logged")
                else:
                    self._send_model(path)
            self._model_sent = True  # (a retry of a failed _finish does not log it again)
        self._finish()

    def _send_next(self) -> bool:
        """Send what is committed and unsent; False once closing and nothing is left (or time is up)."""
        with self._condition:
            while not (self._closing or self._committed > self._first or self._backlog):
                self._condition.wait()
            take = min(self._committed - self._first, len(self._points))
            # Stamped in the order sent (an earlier process's rows first): the tracker's times
            # follow the rows' order. A batch tried again keeps its stamps.
            batch = [point if point.milliseconds else point._replace(milliseconds=self._now())
                     for point in self._backlog + self._points[:take]]
            self._backlog, self._points[:take] = batch[:len(self._backlog)], batch[len(self._backlog):]
            if not batch:
                return False
        if not self._until_done(lambda: self._send(batch)):
            return False
        with self._condition:
            self._backlog = []
            del self._points[:take]
            self._first += take
        return True

    def _until_done(self, call: Callable[[], object]) -> bool:
        """``call()``, tried again every ``retry_seconds`` while it fails; False once closing and
        ``close_timeout`` has passed."""
        while True:
            try:
                call()
                return True
            except Exception as error:  # noqa: BLE001 - the tracker is unreachable or refuses: retry
                if not self._down:
                    self._down = True
                    self._notice(f"{self!r} cannot reach the tracker ({type(error).__name__}: {error}); training "
                                 "goes on, and the committed rows are sent when it answers again")
            with self._condition:
                if self._closing and time.monotonic() >= self._give_up_at:
                    return False
                self._condition.wait(min(self.retry_seconds, max(0.0, self._give_up_at - time.monotonic())))

    def _now(self) -> int:
        """Milliseconds since the epoch, later than every earlier point's (call under the lock):
        the points of one key at one step stay distinct and in the order sent."""
        self._last_milliseconds = max(int(time.time() * 1000), self._last_milliseconds + 1)
        return self._last_milliseconds

    def _notice(self, message: str) -> None:
        with self._condition:
            self._notices.append(message)

    def _raise_notices(self) -> None:
        with self._condition:
            notices, self._notices = self._notices, []
        for message in notices:
            warn_user(message)


def points_missing(committed_rows: Sequence[Row], held: dict[str, int]) -> tuple[list[Point], dict[str, int]]:
    """The points of ``committed_rows`` a tracker run holding ``held[key]`` points of each key
    lacks (the first ``held[key]`` of each key are there: rows are sent in order), and the keys
    of which it holds more than the rows have."""
    remaining = dict(held)
    missing: list[Point] = []
    for number, row in enumerate(committed_rows):
        values = {}
        for key, value in row_scalars(row):
            if remaining.get(key, 0) > 0:
                remaining[key] -= 1
            else:
                values[key] = value
        if values:
            missing.append(Point(row_step(row), values, 0, number))
    return missing, {key: count for key, count in remaining.items() if count > 0}


def read_record(run: RunInfo, name: str) -> dict[str, str] | None:
    """The JSON record ``name`` a tracker keeps in the run directory (its run's id), if any."""
    if run.files is None or not run.files.exists(name):
        return None
    record = json.loads(run.files.read(name).decode())
    return record if isinstance(record, dict) else None


def write_record(run: RunInfo, name: str, record: dict[str, str]) -> None:
    """Replace the record ``name`` in the run directory (nothing without a ``run_dir``)."""
    if run.files is not None:
        run.files.replace(name, json.dumps(record).encode())


def require_package(package: str, message: str) -> None:
    """ConfigError(``message``) when ``package`` is not installed (looked up, not imported)."""
    if importlib.util.find_spec(package) is None:
        raise ConfigError(message)


def _positive(owner: str, field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{owner}.{field}: expected a positive number of seconds, got {value!r}")
    return float(value)
