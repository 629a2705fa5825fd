"""One checkpoint for all ranks: each rank writes its part, rank 0 commits once every part is
durable.

For each checkpoint, in the same order on every rank (saves are agreed at the boundary, and a
distributed writer never skips one):

1. every rank writes its files into the same staging directory
   ``checkpoints/tmp-<sequence>-<attempt>`` (``attempt`` is unique to this try of the group, so
   a restarted group never writes over a previous try's files; on object stores the data goes
   to ``ckpt-<sequence>`` directly, as in the single-process protocol): rank 0 the main files
   (the replicated state and its own per-rank state), rank r > 0 ``rank-<r>.bin`` and
   ``rank-<r>.msgpack``, made durable before the next step;
2. every rank sends rank 0 its files' sizes and checksums and its replicated-state digest
   (a gather on the *writer group*, a gloo group of its own: the background writer thread never
   calls a collective on the training group);
3. rank 0 checks that every part arrived and that the digests agree, then writes the manifest
   listing every rank's files and makes the checkpoint visible at the commit point (the rename
   of the staging directory, fenced by the writer lease; the manifest on object stores);
4. rank 0 broadcasts the outcome (the name, or why it failed) on the writer group, so every
   rank's writer reports the same result.

A rank killed before step 3 leaves a staging directory that readers ignore and the next start
deletes; after it, the checkpoint is whole. Either way no partial checkpoint is visible.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist

from engine.checkpoint.codec import EncodedState, encode_state
from engine.checkpoint.manifest import FileRecord
from engine.checkpoint.store import CHECKPOINT_DIR, CheckpointStore, LoadedCheckpoint, checkpoint_name
from engine.distributed import state_parts
from engine.distributed.environment import DistributedContext
from engine.errors import CheckpointCorrupt, CheckpointError, CheckpointWriteError, ReplicaDivergence

if TYPE_CHECKING:
    from engine.checkpoint.writer import PendingCheckpoint, _Committer


@dataclasses.dataclass
class _PartReport:
    """What one rank tells rank 0 about its part of a checkpoint."""

    records: dict[str, tuple[int, int]]
    digest: dict[str, int]
    error: str | None


class GroupCommit:
    """The commit across ranks for one process of a distributed job (see the module docstring)."""

    def __init__(self, context: DistributedContext) -> None:
        self.context = context
        self._next_sequence = 0

    @property
    def is_writer(self) -> bool:
        return self.context.is_writer

    # ---- start --------------------------------------------------------------------------
    def after_acquire(self, store: CheckpointStore) -> None:
        """Agree on the first sequence number once rank 0 holds the lease and has removed what
        crashed tries left (no rank writes before that)."""
        first = [store.next_sequence() if self.is_writer else 0]
        dist.broadcast_object_list(first, src=0, group=self.context.writer_group)
        self._next_sequence = int(first[0])

    def select(self, choose: Callable[[], LoadedCheckpoint | None], store: CheckpointStore,
               validate: Callable[[str, Any], None]) -> LoadedCheckpoint | None:
        """Rank 0 chooses the checkpoint (``choose``: the single-process choice); every rank
        loads that one and takes its own per-rank part."""
        chosen: list[Any] = [None, None]
        loaded: LoadedCheckpoint | None = None
        if self.is_writer:
            try:
                loaded = choose()
                chosen[0] = None if loaded is None else loaded.name
            except CheckpointError as error:
                chosen[1] = f"{type(error).__name__}: {error}"
                dist.broadcast_object_list(chosen, src=0, group=self.context.writer_group)
                raise
        dist.broadcast_object_list(chosen, src=0, group=self.context.writer_group)
        if chosen[1] is not None:
            raise CheckpointCorrupt(f"rank 0 could not choose a checkpoint to resume from: {chosen[1]}")
        if chosen[0] is None:
            return None
        if loaded is None:
            loaded = store.load(str(chosen[0]), validate)
        return self._own_part(loaded)

    def _own_part(self, loaded: LoadedCheckpoint) -> LoadedCheckpoint:
        name, rank = loaded.name, self.context.rank
        state_parts.check_world_size(name, loaded.state["signature"], self.context.world_size)
        if rank == 0:
            return loaded
        tensors_file, header_file = state_parts.rank_files(rank)
        if tensors_file not in loaded.extra_files or header_file not in loaded.extra_files:
            raise CheckpointCorrupt(f"{name}: the part of rank {rank} ({header_file}) is missing")
        from engine.checkpoint.codec import decode_state
        part = decode_state(bytes(loaded.extra_files[header_file]), loaded.extra_files[tensors_file])
        return dataclasses.replace(loaded, state=state_parts.with_rank_part(name, loaded.state, part))

    # ---- saving -------------------------------------------------------------------------
    def encode(self, state: dict[str, Any], progress_bytes: bytes) -> tuple[EncodedState, dict[str, int]]:
        """What this rank writes (rank 0: the whole tree; others: their per-rank part) and the
        digest of its replicated state."""
        digest = state_parts.replicated_digest(state, progress_bytes)
        written = state if self.is_writer else state_parts.rank_part(state)
        return encode_state(written), digest

    def commit(self, committer: "_Committer", pending: "PendingCheckpoint") -> str:
        """Write this rank's part of ``pending`` and take part in its commit; the name of the
        committed checkpoint, or the error every rank raises when it did not commit."""
        sequence = self._next_sequence
        self._next_sequence += 1
        name = checkpoint_name(sequence)
        staging = f"tmp-{sequence:010d}-{self.context.attempt}" if committer.store.storage.rename_is_atomic else name
        if self.is_writer:
            return self._commit_as_writer(committer, pending, sequence, staging)
        report = self._write_rank_part(committer, pending, f"{CHECKPOINT_DIR}/{staging}")
        self._gather(report)
        outcome = self._announce(None)
        if outcome != name:
            raise _outcome_error(outcome)
        return name

    def _write_rank_part(self, committer: "_Committer", pending: "PendingCheckpoint", directory: str) -> _PartReport:
        storage = committer.store.storage
        tensors_file, header_file = state_parts.rank_files(self.context.rank)
        try:
            storage.makedirs(directory)
            records = {}
            for file_name, chunks in ((tensors_file, pending.encoded.tensor_chunks()),
                                      (header_file, [pending.encoded.header])):
                records[file_name] = storage.write(f"{directory}/{file_name}", chunks, durable=False)
            committer.release(pending)
            storage.sync([f"{directory}/{file_name}" for file_name in records])
        except OSError as error:
            return _PartReport({}, pending.digest or {}, f"rank {self.context.rank}: {type(error).__name__}: {error}")
        finally:
            committer.release(pending)
        return _PartReport(records, pending.digest or {}, None)

    def _commit_as_writer(self, committer: "_Committer", pending: "PendingCheckpoint", sequence: int, staging: str) -> str:
        gathered = False

        def gather_parts() -> dict[str, FileRecord]:
            nonlocal gathered
            gathered = True
            reports = self._gather(_PartReport({}, pending.digest or {}, None))
            return self._check_reports(reports)

        try:
            name = committer.commit_files(pending, sequence, staging, gather_parts)
        except BaseException as error:
            if not gathered:
                self._gather(_PartReport({}, {}, "rank 0 failed first"))
            committer.store.discard_staging(staging)
            self._announce(f"error: {type(error).__name__}: {error}")
            raise
        self._announce(name)
        return name

    def _check_reports(self, reports: list[_PartReport]) -> dict[str, FileRecord]:
        failed = [report.error for report in reports[1:] if report.error is not None]
        if failed:
            raise CheckpointWriteError("a rank could not write its part of the checkpoint: " + "; ".join(failed))
        differing = state_parts.differences([report.digest for report in reports])
        if differing:
            raise ReplicaDivergence(
                "the replicated state differs between ranks, so the checkpoint is not committed: "
                + "; ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
                + ". Every rank must apply the same updates (DDP-synced gradients, same optimizer settings); "
                "the newest committed checkpoint is the last agreed state")
        records: dict[str, FileRecord] = {}
        for rank, report in enumerate(reports[1:], start=1):
            expected = set(state_parts.rank_files(rank))
            if set(report.records) != expected:
                raise CheckpointWriteError(f"rank {rank} reported files {sorted(report.records)}, expected {sorted(expected)}")
            records.update({file_name: FileRecord(size, crc) for file_name, (size, crc) in report.records.items()})
        return records

    def _gather(self, report: _PartReport) -> list[_PartReport]:
        as_plain = (report.records, report.digest, report.error)
        received: list[Any] | None = [None] * self.context.world_size if self.is_writer else None
        dist.gather_object(as_plain, received, dst=0, group=self.context.writer_group)
        if received is None:
            return []
        return [_PartReport(dict(records), dict(digest), error) for records, digest, error in received]

    def _announce(self, outcome: str | None) -> str:
        message = [outcome]
        dist.broadcast_object_list(message, src=0, group=self.context.writer_group)
        return str(message[0])


def _outcome_error(outcome: str) -> CheckpointError:
    if "ReplicaDivergence" in outcome:
        return ReplicaDivergence(f"rank 0 did not commit the checkpoint: {outcome}")
    return CheckpointWriteError(f"rank 0 did not commit the checkpoint: {outcome}")
