"""Who takes part in one checkpoint's commit.

:class:`Committer` is how this process takes part in a commit, chosen once when the writer is
built: :class:`SingleCommitter` for a single process; a distributed job's ranks use
:class:`engine.distributed.commit.GroupCommit`, where each rank writes its part and rank 0
commits once every part is durable.
"""

from __future__ import annotations

from typing import Protocol

from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.request import CommitCallbacks, CommitRequest
from engine.checkpoint.writers.pending import PendingCheckpoint


class Committer(Protocol):
    """How this process takes part in committing a checkpoint (see the module docstring). Per
    checkpoint the writer calls :meth:`prepare`, then (where :attr:`commits`, after its fence
    check and the metrics lines) :meth:`write`, then :meth:`settle` with the outcome."""

    @property
    def commits(self) -> bool:
        """Whether this process makes checkpoints visible, and so checks the fence, publishes
        the metrics lines and applies retention (False: it only writes its part)."""
        ...

    def prepare(self, store: CheckpointStore, request: CommitRequest) -> CommitRequest:
        """``request`` with what the committer decides: the sequence and the staging directory
        of a checkpoint shared by several ranks. Called for every checkpoint, first."""
        ...

    def write(self, store: CheckpointStore, pending: PendingCheckpoint, request: CommitRequest,
              callbacks: CommitCallbacks) -> str:
        """Write this process's files of ``pending`` and commit (or take part in the commit),
        with the writer's ``callbacks``; the checkpoint's name."""
        ...

    def settle(self, store: CheckpointStore, outcome: str | BaseException) -> None:
        """The checkpoint's commit ended, with a name or an error (only where :attr:`commits`:
        after the fence check and retention that follow the commit point)."""
        ...


class SingleCommitter:
    """The :class:`Committer` of a single process: it writes and commits alone."""

    commits = True

    def prepare(self, store: CheckpointStore, request: CommitRequest) -> CommitRequest:
        return request

    def write(self, store: CheckpointStore, pending: PendingCheckpoint, request: CommitRequest,
              callbacks: CommitCallbacks) -> str:
        return store.write(request, callbacks)

    def settle(self, store: CheckpointStore, outcome: str | BaseException) -> None:
        pass
