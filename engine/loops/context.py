"""State shared by the loops of one fit: where the run is and whether it must stop."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Position:
    """Indices of the epoch, batch (within the epoch) and split (within the batch) in progress."""

    epoch: int = 0
    batch: int = 0
    split: int = 0


@dataclasses.dataclass
class StopState:
    """Why the run should stop at the next boundary; empty while it should go on.

    The first reason given is kept, except that a preemption always wins: a scheduler that
    sent the signal must learn that the run stopped for it, whatever else asked to stop in the
    same split. ``finish_reason`` keeps the first stop that is not a preemption (a limit, a
    callback's request): that stop *finishes* the run, and checkpoints record it, even when a
    preemption arrived in the same split."""

    reason: str | None = None
    preempted: bool = False
    finish_reason: str | None = None

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        if self.finish_reason is None:
            self.finish_reason = reason

    def request_preemption(self, reason: str) -> None:
        self.reason = reason
        self.preempted = True
