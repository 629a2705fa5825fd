"""What each loop level needs from the level below it, as Protocols::

    FitLoop -> EpochLoop -> BatchRunner (SplitLoop | WholeBatch)
                          -> SplitRunner (OptimizerLoop | SingleOptimizer) -> Flow

Calls cascade down one level at a time (``end_epoch`` included); no level reaches past the
one below it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.loops.step_output import Hidden

Losses = list[torch.Tensor]


class Flow(Protocol):
    """The innermost level: calls the user's step for one split and one optimizer."""

    def run(self, batch: Any, hidden: Hidden, optimizer_index: int, last_split: bool) -> tuple[torch.Tensor, Hidden]:
        """Run the step; returns the detached loss and the new hidden state."""
        ...

    def end_epoch(self) -> None:
        """Finish what the epoch left open (accumulation window, epoch-interval schedulers)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...


class SplitRunner(Protocol):
    """Runs one split through every optimizer."""

    def run_split(self, batch: Any, hidden: Hidden, last_split: bool) -> tuple[Losses, Hidden]:
        """Returns one loss per optimizer and the hidden state to carry on."""
        ...

    def end_epoch(self) -> None:
        ...


class BatchRunner(Protocol):
    """Runs one batch: its TBPTT splits, or the whole batch as one unit."""

    def run_batch(self, batch: Any, batch_index: int) -> Losses | None:
        """Run what remains of the batch; the last unit's losses, or None when a stop was
        requested before the batch ended."""
        ...

    def skip_batch(self) -> None:
        """Drop what remains of the batch in progress (a rollback skips it)."""
        ...

    def end_epoch(self) -> None:
        ...
