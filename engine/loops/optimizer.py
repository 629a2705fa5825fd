"""The optimizer loop: run the flow once per optimizer for the same split."""

from __future__ import annotations

from typing import Any

import torch

from engine.loops.contracts import Flow
from engine.loops.step_output import Hidden
from progress import Progress


class OptimizerLoop:
    """Runs ``flow.run`` for optimizer 0, 1, ... of one split. Each optimizer's step receives the
    hidden state of the previous split; the state carried on is the last optimizer's."""

    def __init__(self, flow: Flow, optimizer_count: int) -> None:
        self.flow = flow
        self.progress = Progress()
        self._indices = range(optimizer_count)

    def run_split(self, batch: Any, hidden: Hidden, last_split: bool) -> tuple[list[torch.Tensor], Hidden]:
        losses = []
        new_hidden: Hidden = None
        progress = self.progress
        for index in self._indices:
            progress.increment_ready()
            progress.increment_started()
            loss, new_hidden = self.flow.run(batch, hidden, index, last_split)
            losses.append(loss)
            progress.increment_processed()
            progress.increment_completed()
        progress.reset_current()
        return losses, new_hidden

    def end_epoch(self) -> None:
        self.flow.end_epoch()


class SingleOptimizer:
    """The one-optimizer case: call the flow directly, no optimizer loop level."""

    def __init__(self, flow: Flow) -> None:
        self.flow = flow

    def run_split(self, batch: Any, hidden: Hidden, last_split: bool) -> tuple[list[torch.Tensor], Hidden]:
        loss, new_hidden = self.flow.run(batch, hidden, 0, last_split)
        return [loss], new_hidden

    def end_epoch(self) -> None:
        self.flow.end_epoch()
