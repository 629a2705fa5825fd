"""What ``Trainer.fit`` returns."""

from __future__ import annotations

import dataclasses

from progress import Cursor, ProgressTree


@dataclasses.dataclass(frozen=True)
class FitResult:
    """Where the run ended.

    Attributes:
        cursor: the last completed split, or None if none ran.
        epochs_completed: epochs completed over the whole run (resumes included).
        optimizer_steps: optimizer steps over the whole run, all optimizers together.
        stop_reason: why it stopped before max_epochs (max_steps, max_time, a callback,
            preemption), or None.
        resumed_from: the checkpoint this call resumed from, or None for a fresh start.
        last_checkpoint: the newest checkpoint this call wrote, or None.
        progress: every loop's progress record at the end, with the cursor.
        resumed_cursor: the cursor of the checkpoint this call resumed from.
        preempted: the run stopped because a preemption signal arrived (a checkpoint of the
            last completed split was committed first).
        metrics: the newest value of every metric logged with ``Module.log`` or returned by
            ``validation_step`` (over the whole run, resumes included).
        checkpoint_interval: splits between checkpoints at the end of the run: the interval
            ``CheckpointConfig(every_n_splits="auto")`` reached, else ``every_n_splits``; None
            without checkpoints or a split cadence.
    """

    cursor: Cursor | None
    epochs_completed: int
    optimizer_steps: int
    stop_reason: str | None
    resumed_from: str | None
    last_checkpoint: str | None
    progress: ProgressTree
    preempted: bool = False
    resumed_cursor: Cursor | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    checkpoint_interval: int | None = None
