"""The epoch loop: run each batch of one epoch."""

from __future__ import annotations

from typing import Callable

from engine import faults, watchdog
from engine.data.position import EXHAUSTED, EpochData
from engine.errors import DataError, warn as warn_user
from engine.loops.anomaly import AnomalyHistory
from engine.loops.context import Position, StopState
from engine.loops.contracts import BatchRunner, Losses
from progress import Progress

BatchBoundary = Callable[[int, Losses], None]


class EpochLoop:
    """Draws batches from :class:`EpochData` and hands each to the batch runner (the split
    loop, or :class:`WholeBatch` without TBPTT). ``batch_boundary`` is called after each
    completed batch when the batch itself is the unit of step work."""

    def __init__(
        self,
        data: EpochData,
        runner: BatchRunner,
        position: Position,
        stop: StopState,
        batch_boundary: BatchBoundary | None,
        anomalies: AnomalyHistory | None = None,
    ) -> None:
        self.anomalies = anomalies if anomalies is not None else AnomalyHistory()
        self.progress = Progress()
        self.data = data
        self.runner = runner
        self._position = position
        self._stop = stop
        self._batch_boundary = batch_boundary
        self._warned_length = False

    def run_epoch(self, epoch: int) -> bool:
        """Run the epoch's remaining batches; False if a stop was requested before its end."""
        iterator = self.data.open_epoch(epoch)
        progress = self.progress
        while True:
            watchdog.mark(watchdog.DATA)
            batch = self.data.next_batch(iterator)
            if batch is EXHAUSTED:
                break
            index = progress.current.completed
            self._position.batch = index
            progress.increment_ready()
            progress.increment_started()
            if self.anomalies.skips(epoch, index):
                self._skip()
                continue
            losses = self.runner.run_batch(batch, index)
            if losses is None:
                return False
            progress.increment_processed()
            progress.increment_completed()
            self.data.batch_done()
            faults.reach("batch_end")
            if self._batch_boundary is not None:
                self._position.split = 0
                self._batch_boundary(0, losses)
            if self._stop.requested:
                return False
        if progress.current.completed == 0:
            raise DataError(f"the training data yielded no batch in epoch {epoch}")
        self._check_length(epoch, progress.current.completed)
        progress.reset_current()
        self.data.epoch_done()
        return True

    def _skip(self) -> None:
        """A batch a rollback skips: drawn (the data position moves on) but never trained."""
        self.runner.skip_batch()
        progress = self.progress
        progress.increment_processed()
        progress.increment_completed()
        self.data.batch_done()

    def _check_length(self, epoch: int, batches: int) -> None:
        """Warn, once per run, when the data's ``len()`` is not the number of batches an epoch
        yielded: the progress display, and resuming a loader with ``state_dict()`` at an
        epoch's very end, go by ``len()``."""
        length = self.data.length
        if length is not None and batches != length and not self._warned_length:
            self._warned_length = True
            warn_user(f"len(train_data) is {length} but epoch {epoch} yielded {batches} batches: make __len__ "
                      "return the number of batches __iter__ yields")

    def end_epoch(self) -> None:
        """Cascade the end of the epoch to the levels below (after its last batch)."""
        self.runner.end_epoch()
