"""The TBPTT loop: cut a batch into splits, run each with the previous split's hidden state."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from engine.loops.context import Position, StopState
from engine.loops.contracts import Losses, SplitRunner
from engine.loops.step_output import Hidden, describe_tree, detach_hidden
from engine.data.splitting import check_splits
from progress import Progress

SplitBoundary = Callable[[int, "list[torch.Tensor]"], None]


class SplitLoop:
    """Runs the splits of one batch in order, from the first not yet completed.

    ``current`` split counts and (unless hidden state is carried across batches) the hidden
    state are reset when a batch *ends*, so a run restored in the middle of a batch simply
    carries on from its counters.
    """

    def __init__(
        self,
        splitter: Callable[[Any, int], Sequence[Any]],
        split_length: int,
        carry_hidden_across_batches: bool,
        runner: SplitRunner,
        position: Position,
        stop: StopState,
        boundary: SplitBoundary,
    ) -> None:
        self.progress = Progress()
        self.hidden: Hidden = None
        # Every split of the batch in flight is done (its last split's boundary, before the
        # epoch loop ends the batch): nothing of the batch is left to run.
        self.batch_finished = False
        self._splitter = splitter
        self._split_length = split_length
        self._carry = carry_hidden_across_batches
        self._runner = runner
        self._position = position
        self._stop = stop
        self._boundary = boundary

    def run_batch(self, batch: Any, batch_index: int) -> Losses | None:
        """Run the remaining splits; their last losses, or None if a stop was requested
        before the batch ended."""
        splits = check_splits(self._splitter(batch, self._split_length), batch_index)
        last = len(splits) - 1
        progress = self.progress
        losses: Losses = []  # stays empty when resumed after the batch's last split
        for index in range(progress.current.completed, last + 1):
            self._position.split = index
            progress.increment_ready()
            progress.increment_started()
            try:
                losses, hidden = self._runner.run_split(splits[index], self.hidden, index == last)
            except Exception as error:
                _note_split(error, self._position, last + 1, splits[index], self.hidden)
                raise
            self.hidden = detach_hidden(hidden)
            progress.increment_processed()
            progress.increment_completed()
            self.batch_finished = index == last
            self._boundary(index, losses)
            if self._stop.requested:
                return None
        progress.reset_current()
        self.batch_finished = False
        if not self._carry:
            self.hidden = None
        return losses

    def skip_batch(self) -> None:
        """The batch is skipped (a rollback past an anomaly): what remains of it is not run."""
        self.progress.reset_current()
        self.batch_finished = False
        if not self._carry:
            self.hidden = None

    def end_epoch(self) -> None:
        self.hidden = None
        self._runner.end_epoch()

    def state_dict(self) -> dict[str, Any]:
        return {"hidden": self.hidden, "batch_finished": self.batch_finished}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.hidden = state["hidden"]
        # Checkpoints of earlier versions lack it: taken as inside the batch.
        self.batch_finished = bool(state.get("batch_finished", False))


def _note_split(error: Exception, position: Position, splits: int, split: Any, hidden: Hidden) -> None:
    """Say, under the traceback of an error raised in the user's step, which split it was and
    what the step got: a hidden state of the wrong shape is the usual cause with TBPTT."""
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(f"splitloop: raised in epoch {position.epoch} batch {position.batch} split {position.split} "
                       f"(of {splits}); the split was {describe_tree(split)}; the hidden state passed in was "
                       f"{describe_tree(hidden)} (None at a batch's first split)")


class WholeBatch:
    """Without TBPTT: a batch is one unit of step work (no split level, no hidden state)."""

    def __init__(self, runner: SplitRunner) -> None:
        self._runner = runner

    def run_batch(self, batch: Any, batch_index: int) -> Losses | None:
        losses, _ = self._runner.run_split(batch, None, True)
        return losses

    def skip_batch(self) -> None:
        pass

    def end_epoch(self) -> None:
        self._runner.end_epoch()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
