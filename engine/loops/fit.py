"""The fit loop: run epochs until a stop condition holds."""

from __future__ import annotations

from typing import Callable

from engine.loops.context import Position, StopState
from engine.loops.epoch import EpochLoop
from engine.loops.stop import epochs_done
from progress import Progress


class FitLoop:
    """Runs epochs; at each epoch end cascades ``end_epoch`` down the tree (the flow steps
    what it left open and the epoch-interval schedulers) and calls ``epoch_boundary``
    (callbacks, stop checks, checkpoint)."""

    def __init__(
        self,
        epoch_loop: EpochLoop,
        max_epochs: int | None,
        position: Position,
        stop: StopState,
        epoch_boundary: Callable[[int], None],
    ) -> None:
        self.progress = Progress()
        self.epoch_loop = epoch_loop
        self._max_epochs = max_epochs
        self._position = position
        self._stop = stop
        self._epoch_boundary = epoch_boundary

    def done(self) -> bool:
        return self._stop.requested or epochs_done(self.progress.total.completed, self._max_epochs)

    def run(self) -> None:
        progress = self.progress
        while not self.done():
            epoch = progress.total.completed
            self._position.epoch = epoch
            progress.increment_ready()
            progress.increment_started()
            if not self.epoch_loop.run_epoch(epoch):
                return
            progress.increment_processed()
            self.epoch_loop.end_epoch()
            progress.increment_completed()
            self._epoch_boundary(epoch)
