"""``engine.loggers.TensorBoard``: the rows of metrics.jsonl as TensorBoard scalars.

Each row's values become scalars at the row's optimizer ``step``, tagged ``<stage>/<name>``:
``train/loss`` (``train/loss_0``, ``train/loss_1``, ... with several optimizers) and
``train/<metric>`` for a training split, ``val/<metric>`` for a validation pass,
``train_epoch/<metric>`` for an epoch's aggregates.

Resume: the interrupted process may have written scalars after the checkpoint. The resumed
process opens a new event file with ``purge_step`` at the resumed step (TensorBoard's readers
drop every earlier event at that step or later), then writes again the committed rows from that
step on (a step can hold several rows: a split's and the validation after it), then trains on.
Every step is there once, with the values of a run that was never interrupted. TensorBoard reads
a directory's event files in the order of their names, which begin with the second they were
created: the new file is created in a later second than the newest one there.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import time
from typing import TYPE_CHECKING, Sequence

from engine.errors import ConfigError, warn as warn_user
from engine.loggers.base import Logger, Row, local_path, refuse_existing, row_scalars, row_step

if TYPE_CHECKING:  # pragma: no cover - the import is optional and happens when a run starts
    from torch.utils.tensorboard import SummaryWriter

_EVENT_FILE_SECOND = re.compile(r"events\.out\.tfevents\.(\d+)\.")
# How long to wait for a later second than the newest event file's; beyond it the clock is off.
_MAX_WAIT_SECONDS = 2.0


class TensorBoard(Logger):
    """Write the run's metrics as TensorBoard scalars into ``log_dir`` (needs the ``tensorboard``
    package: ``pip install 'splitloop[tensorboard]'``)::

        config = engine.TrainerConfig(run_dir="runs/a", loggers=[engine.loggers.TensorBoard("runs/a/tb")])

    Args:
        log_dir: a local directory (created if needed); ``tensorboard --logdir`` it.
        flush_secs: how often the writer flushes on its own, besides at every checkpoint.
    """

    def __init__(self, log_dir: str | os.PathLike[str], flush_secs: float = 30.0) -> None:
        self.log_dir = local_path("TensorBoard", "log_dir", log_dir)
        refuse_existing("TensorBoard", "log_dir", self.log_dir, must_be_directory=True)
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)) or not flush_secs > 0:
            raise ConfigError(f"TensorBoard.flush_secs: expected a positive number of seconds, got {flush_secs!r}")
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("engine.loggers.TensorBoard needs the tensorboard package, which is not installed: "
                              "pip install 'splitloop[tensorboard]' (or pip install tensorboard)")
        self.flush_secs = float(flush_secs)
        self._writer: SummaryWriter | None = None

    def __repr__(self) -> str:
        return f"engine.loggers.TensorBoard({self.log_dir!r})"

    def start_fresh(self) -> None:
        # Purging from step 0 hides whatever an earlier run left in the directory.
        self._open(purge_step=0)

    def resume(self, committed_rows: Sequence[Row], resumed_step: int) -> None:
        self._open(purge_step=resumed_step)
        for row in committed_rows:
            if row_step(row) >= resumed_step:
                self.log_row(row)

    def log_row(self, row: Row) -> None:
        writer = self._writer
        if writer is None:
            return
        step = row_step(row)
        for tag, value in row_scalars(row):
            writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def _open(self, purge_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.close()
        os.makedirs(self.log_dir, exist_ok=True)
        _wait_past_newest_event_file(self.log_dir)
        self._writer = SummaryWriter(self.log_dir, purge_step=purge_step, flush_secs=int(max(1, self.flush_secs)))


def _wait_past_newest_event_file(log_dir: str) -> None:
    """Let the event file about to be created sort after every file already in ``log_dir``."""
    seconds = [int(match.group(1)) for path in glob.glob(os.path.join(glob.escape(log_dir), "events.out.tfevents.*"))
               if (match := _EVENT_FILE_SECOND.match(os.path.basename(path)))]
    if not seconds:
        return
    deadline = time.monotonic() + _MAX_WAIT_SECONDS
    while int(time.time()) <= max(seconds) and time.monotonic() < deadline:
        time.sleep(0.02)
    if int(time.time()) <= max(seconds):
        warn_user(f"{log_dir} holds an event file created at {max(seconds)}, later than this machine's clock; "
                  "TensorBoard may read this run's scalars before it (check the clocks)")
