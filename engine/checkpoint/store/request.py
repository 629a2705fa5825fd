"""What one commit of a checkpoint is given: :class:`CommitRequest` holds everything
:meth:`CheckpointStore.write` needs to know of one checkpoint, as plain data (its files a
:class:`CheckpointFiles`); what the writer does at two points of the commit (the fence check
before the commit point, the release of the snapshot once its bytes are written) comes beside
it, as :class:`CommitCallbacks`. Who takes part in the commit is the writers'
:class:`~engine.checkpoint.writers.committer.Committer`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from engine.checkpoint.format.encoded_state import EncodedState
from engine.checkpoint.format.manifest import FileRecord, MonitorRecord
from progress import Cursor

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
    # The monitored metric's value this checkpoint records (best checkpoints).
    monitor: MonitorRecord | None = None
    # Resumable on another world size (the manifest's ``anchor``).
    anchor: bool = False
    # The staging directory under checkpoints/ that several ranks share (None: this process's
    # own, see engine.checkpoint.store.staged).
    staging: str | None = None


    @classmethod
    def of_state(cls, encoded: EncodedState, progress_bytes: bytes, cursor: Cursor | None, generation: int,
                 sequence: int | None = None, monitor: MonitorRecord | None = None,
                 staging: str | None = None) -> CommitRequest:
        """The request to commit an encoded state tree and its progress tree."""
        return cls(CheckpointFiles.of_state(encoded, progress_bytes), cursor, generation, sequence,
                   monitor=monitor, staging=staging)


@dataclasses.dataclass(frozen=True)
class CommitCallbacks:
    """What the writer does at two points of one commit (beside its :class:`CommitRequest`)."""

    # Raises WriterConflict when this writer lost its lease; runs immediately before the
    # commit point.
    fence: Callable[[], None] | None = None
    # Called once the data's bytes are no longer read (the snapshot's buffers may be reused).
    on_data_written: Callable[[], None] | None = None


NO_CALLBACKS = CommitCallbacks()
