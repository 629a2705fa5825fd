"""What the rest of engine.checkpoint sees of a writer: the one :class:`Writer` protocol (every
writer satisfies it; engine.checkpoint.writers.choice builds one), and what a writer needs of a
fast tier in front of the run dir (:class:`FastTierCommits`)."""

from __future__ import annotations

from typing import Callable, Protocol

from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.writers.pending import PendingCheckpoint
from engine.checkpoint.writers.worker import BackgroundWork


class Writer(Protocol):
    """What a run's checkpointer needs of its writer, whichever it is."""

    @property
    def last_name(self) -> str | None:
        """The name of the last checkpoint this writer committed (None before the first)."""
        ...

    def submit(self, pending: PendingCheckpoint, force: bool = False) -> bool:
        """Commit, or queue, ``pending``; False when it was skipped (``when_behind="skip"``)."""
        ...

    def check(self) -> None:
        """Raise, on the training thread, an error the writer met in the background."""
        ...

    def flush(self) -> None:
        """Wait until every queued checkpoint is committed (or failed)."""
        ...

    def close(self) -> None:
        """Flush, then stop (its last error is raised)."""
        ...

    def background_work(self) -> BackgroundWork | None:
        """What tells the overhead budget whether a split overlapped this writer's work (None:
        it does nothing beside training)."""
        ...


class FastTierCommits(Protocol):
    """A fast tier in front of the run dir (engine.checkpoint.tiers.fast.TierWriter): commits go
    there first."""

    def commit(self, write: Callable[[CheckpointStore, int], str], durable: bool,
               fence: Callable[[], None] | None, best_candidate: bool = False) -> str:
        """``write(store, sequence)`` commits to the fast tier; the name (see TierWriter.commit)."""
        ...
