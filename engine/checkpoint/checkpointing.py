"""What a run asks of its checkpoints, and the run without any.

:class:`~engine.run.run.FitRun` holds one :class:`Checkpointing`, chosen once, and hands the run's
start its :class:`ResumeSource` side and the boundaries its :class:`CheckpointSink` side: a
:class:`~engine.checkpoint.policy.RunCheckpointer` when the run has a run dir and a checkpoint
policy, else :class:`NoCheckpoints`, which never saves and writes the metrics lines at the end.
The run calls either the same way and never asks which it holds.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from engine.checkpoint.resume_choice import AnchorFallback
from engine.checkpoint.store.checkpoint_store import LoadedCheckpoint, StateValidator
from engine.checkpoint.store.metrics_log import MetricsLog
from engine.errors import CheckpointNotFound
from progress import Cursor

# Names a boundary: (units of step work, epochs) completed.
BoundaryMark = tuple[int, int]


class Snapshot(Protocol):
    """What a run hands over to be saved (engine.run.state.RunSnapshot): the state tree, the
    encoded progress, and what the commit publishes besides (the length of metrics.jsonl)."""

    state: dict[str, Any]
    progress_bytes: bytes

    @property
    def metrics_bytes(self) -> int: ...

    @property
    def anchor(self) -> bool:
        """Whether the checkpoint can be resumed on another world size (the manifest's ``anchor``)."""
        ...


class ResumeSource(Protocol):
    """What a run's start needs of its checkpoints (engine.run.start): the writer lease, the
    choice of the checkpoint to resume from, and what a resume from an older one abandons."""

    def acquire(self) -> None:
        """Take the writer lease; before :meth:`select`."""

    @property
    def anchor_fallback(self) -> AnchorFallback | None:
        """Set by :meth:`select` (on the process that chose) when "auto" went back to an anchor."""

    def select(self, resume: str, validate: StateValidator,
               needs_an_anchor: Callable[[LoadedCheckpoint], bool] | None = None) -> LoadedCheckpoint | None:
        """The checkpoint to resume from (``resume`` as in ``Trainer.fit``); None: start fresh.
        ``needs_an_anchor``: see RunCheckpointer.select."""

    def abandon_newer_than(self, name: str) -> list[str]:
        """Record the checkpoints newer than ``name`` as abandoned; their names."""

    def existing_names(self) -> list[str]:
        """The checkpoints the run dir holds, oldest first."""


class CheckpointSink(Protocol):
    """What a run's boundaries need of its checkpoints (engine.run.run, engine.run.exception_save):
    whether one is due, the save, and the end."""

    @property
    def last_name(self) -> str | None:
        """The last checkpoint this process wrote (None: none)."""

    @property
    def checkpoint_interval(self) -> int | None:
        """Splits between checkpoints: the one "auto" reached, the configured one, or None."""

    @property
    def auto_interval(self) -> int | None:
        """The interval ``every_n_splits="auto"`` chose so far (None without "auto")."""

    def start(self, optimizer_steps: int, resumed_mark: BoundaryMark | None) -> None:
        """Training starts (after any resume at ``resumed_mark``)."""

    def holds(self, mark: BoundaryMark) -> bool:
        """Whether no checkpoint is needed to keep the state at boundary ``mark``."""

    def due_at_split(self, units_completed: int, optimizer_steps: int, asked: bool = False) -> bool:
        """Whether to save at this split boundary (``asked``: the run wants one, to stop or
        after a validation)."""

    def due_at_epoch_end(self, asked: bool = False) -> bool:
        """Whether to save after this epoch's end-of-epoch work (``asked``: to stop)."""

    def offer_metrics(self, values: dict[str, float]) -> None:
        """New metric values were produced at the current boundary."""

    def save(self, snapshot: Snapshot, cursor: Cursor | None, optimizer_steps: int, mark: BoundaryMark,
             force: bool) -> bool:
        """Save ``snapshot``; whether it was written (or queued)."""

    def flush(self) -> None:
        """Wait until every queued checkpoint is committed, then surface any write error."""

    def check(self) -> None:
        """Surface a background error on the training thread."""

    def close(self, failing: bool) -> None:
        """The run ends (``failing``: an exception is on its way up)."""


class Checkpointing(ResumeSource, CheckpointSink, Protocol):
    """A run's checkpoints, from the writer lease to the last flush: what
    :class:`~engine.run.run.FitRun` holds, handing each side only its door."""


class NoCheckpoints:
    """A run without a run dir or a checkpoint policy: nothing is saved; the metrics lines
    (when there is a run dir) are written at the end of a run that did not fail."""

    last_name: str | None = None
    checkpoint_interval: int | None = None
    auto_interval: int | None = None
    anchor_fallback: AnchorFallback | None = None

    def __init__(self, metrics: MetricsLog) -> None:
        self._metrics = metrics
        metrics.rows_final_when_added()

    def acquire(self) -> None:
        pass

    def select(self, resume: str, validate: StateValidator,
               needs_an_anchor: Callable[[LoadedCheckpoint], bool] | None = None) -> LoadedCheckpoint | None:
        """Only a fresh start: resuming needs checkpoints."""
        if resume not in ("auto", "off"):
            raise CheckpointNotFound(f"resume={resume!r} needs TrainerConfig.run_dir and a checkpoint policy")
        return None

    def abandon_newer_than(self, name: str) -> list[str]:
        return []

    def existing_names(self) -> list[str]:
        return []

    def start(self, optimizer_steps: int, resumed_mark: BoundaryMark | None) -> None:
        pass

    def holds(self, mark: BoundaryMark) -> bool:
        return True

    def due_at_split(self, units_completed: int, optimizer_steps: int, asked: bool = False) -> bool:
        return False

    def due_at_epoch_end(self, asked: bool = False) -> bool:
        return False

    def offer_metrics(self, values: dict[str, float]) -> None:
        pass

    def save(self, snapshot: Snapshot, cursor: Cursor | None, optimizer_steps: int, mark: BoundaryMark,
             force: bool) -> bool:
        return False

    def flush(self) -> None:
        pass

    def check(self) -> None:
        pass

    def close(self, failing: bool) -> None:
        """Write the buffered metrics lines, unless the run is failing."""
        if not failing:
            self._metrics.flush()
