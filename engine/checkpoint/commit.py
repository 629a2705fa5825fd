"""What one commit of a checkpoint is given, and who takes part in it.

:class:`CommitRequest` holds everything :meth:`CheckpointStore.write` needs for one checkpoint.
:class:`Committer` is how this process takes part in a commit, chosen once when the writer is
built: :class:`SingleCommitter` for a single process; a distributed job's ranks use
:class:`engine.distributed.commit.GroupCommit`, where each rank writes its part and rank 0
commits once every part is durable.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from engine.checkpoint.encoded_state import EncodedState
from engine.checkpoint.manifest import FileRecord, MonitorRecord
from progress import Cursor

if TYPE_CHECKING:
    from engine.checkpoint.store import CheckpointStore
    from engine.checkpoint.writer import PendingCheckpoint

Chunks = list[memoryview | bytes]


@dataclasses.dataclass
class CheckpointFiles:
    """The data files of one checkpoint: each file's name and content as buffers."""

    contents: dict[str, Chunks]
    # The size of tensors.bin (a large one is checksummed while its file reaches the disk).
    tensor_bytes: int
    # The files' records, already verified against these very bytes (a copy between tiers), so
    # not checksummed again; None: checksum them while writing.
    known: dict[str, FileRecord] | None = None

    @classmethod
    def of_state(cls, encoded: EncodedState, progress_bytes: bytes) -> CheckpointFiles:
        """The files of an encoded state tree and its progress tree."""
        return cls({"tensors.bin": encoded.tensor_chunks(), "state.msgpack": [encoded.header],
                    "progress.msgpack": [progress_bytes]}, encoded.tensor_bytes)


@dataclasses.dataclass
class CommitRequest:
    """One checkpoint to commit (:meth:`CheckpointStore.write`)."""

    files: CheckpointFiles
    cursor: Cursor | None
    # The writer lease's generation (0 without a lease); readers order checkpoints by it.
    generation: int
    # None: the next free sequence of the store.
    sequence: int | None = None
    # Other files (metrics.jsonl) made durable in the same fsync batch as the checkpoint.
    also_sync: Sequence[str] = ()
    # Called once the data's bytes are no longer read (the snapshot's buffers may be reused).
    on_data_written: Callable[[], None] | None = None
    # Raises WriterConflict when this writer lost its lease; runs immediately before the
    # commit point.
    fence: Callable[[], None] | None = None
    # The monitored metric's value this checkpoint records (best checkpoints).
    monitor: MonitorRecord | None = None
    # Resumable on another world size (the manifest's ``anchor``).
    anchor: bool = False
    # The staging directory under checkpoints/ that several ranks share (None: this process's
    # own, see engine.checkpoint.staged).
    staging: str | None = None


    @classmethod
    def of_state(cls, encoded: EncodedState, progress_bytes: bytes, cursor: Cursor | None, generation: int,
                 sequence: int | None = None, fence: Callable[[], None] | None = None,
                 monitor: MonitorRecord | None = None, staging: str | None = None) -> CommitRequest:
        """The request to commit an encoded state tree and its progress tree."""
        return cls(CheckpointFiles.of_state(encoded, progress_bytes), cursor, generation, sequence,
                   fence=fence, monitor=monitor, staging=staging)


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

    def write(self, store: CheckpointStore, pending: PendingCheckpoint, request: CommitRequest) -> str:
        """Write this process's files of ``pending`` and commit (or take part in the commit);
        the checkpoint's name."""
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

    def write(self, store: CheckpointStore, pending: PendingCheckpoint, request: CommitRequest) -> str:
        return store.write(request)

    def settle(self, store: CheckpointStore, outcome: str | BaseException) -> None:
        pass
