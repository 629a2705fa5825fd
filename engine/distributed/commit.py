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
from typing import Any, Callable

import torch.distributed as dist

from engine import watchdog
from engine.checkpoint.format.codec import EncodedState, encode_state
from engine.checkpoint.store.request import CommitCallbacks, CommitRequest
from engine.checkpoint.format.manifest import FileRecord
from engine.checkpoint.format.state_keys import SIGNATURE
from engine.checkpoint.writers.pending import PendingCheckpoint
from engine.checkpoint.tiers.node import NodeTier
from engine.checkpoint.store.checkpoint_store import CHECKPOINT_DIR, CheckpointStore, LoadedCheckpoint, StateValidator, checkpoint_name
from engine.distributed import state_parts
from engine.distributed.environment import WRITER_GROUP_TIMEOUT, DistributedContext
from engine.distributed.writer_group_spec import NAMESPACE, WriterGroupSpec, store_address
from engine.errors import CheckpointCorrupt, CheckpointError, CheckpointWriteError, ReplicaDivergence



@dataclasses.dataclass
class _PartReport:
    """What one rank tells rank 0 about its part of a checkpoint."""

    records: dict[str, tuple[int, int]]
    digest: dict[str, int]
    error: str | None
    # What failed in its memory tier (engine.distributed.memory_commit; None: nothing, or none).
    memory_error: str | None = None


@dataclasses.dataclass
class _Round:
    """The checkpoint being committed: its staging directory, and whether rank 0 gathered the
    other ranks' reports yet (they wait in that gather whatever happens)."""

    staging: str
    gathered: bool = False


class GroupCommit:
    """The commit across ranks for one process of a distributed job (see the module docstring):
    the :class:`engine.checkpoint.store.request.Committer` of each rank, chosen once when the run is
    distributed."""

    def __init__(self, context: DistributedContext) -> None:
        self.context = context
        self._next_sequence = 0
        self._round = _Round("")

    @property
    def is_writer(self) -> bool:
        return self.context.is_writer

    @property
    def node_tier(self) -> NodeTier | None:
        """This rank's memory tier (engine.distributed.memory_commit); None: the run dir only."""
        return None

    # ---- start --------------------------------------------------------------------------
    def after_acquire(self, store: CheckpointStore) -> None:
        """Agree on the first sequence number once rank 0 holds the lease and has removed what
        crashed tries left (no rank writes before that)."""
        first = [store.next_sequence() if self.is_writer else 0]
        dist.broadcast_object_list(first, src=0, group=self.context.writer_group)
        self._next_sequence = int(first[0])

    def handover(self) -> dict[str, Any]:
        """What this rank agreed at the start (after :meth:`after_acquire`), for the committer
        that takes over its commits in a writer process (:meth:`take_over`; engine.distributed.
        writer_processes): plain data."""
        return {"next_sequence": self._next_sequence, "local_tier": None}

    def writer_process_spec(self) -> dict[str, Any]:
        """What this rank's writer process joins the other ranks' with and commits from
        (engine.distributed.writer_processes), once the start is agreed: plain data."""
        host, port = store_address()
        context = self.context
        return WriterGroupSpec(context.rank, context.world_size, host, port, f"{NAMESPACE}/{context.attempt}",
                               WRITER_GROUP_TIMEOUT.total_seconds(), context.attempt, self.handover()).to_dict()

    def take_over(self, handed: dict[str, Any]) -> None:
        """Commit from where the committer that wrote ``handed`` (:meth:`handover`) agreed to start."""
        self._next_sequence = int(handed["next_sequence"])

    def select(self, choose: Callable[[], LoadedCheckpoint | None], store: CheckpointStore,
               validate: StateValidator, newest_wanted: bool = False) -> LoadedCheckpoint | None:
        """Rank 0 chooses the checkpoint (``choose``: the single-process choice); every rank
        loads that one and takes its own per-rank part. (``newest_wanted``: see
        engine.distributed.memory_commit; the run dir holds every checkpoint here.)"""
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
        if rank == 0 or state_parts.saved_world_size(loaded.state[SIGNATURE]) != self.context.world_size:
            # Another world size: every rank starts from rank 0's part, and the restore derives
            # each rank's streams again (engine.distributed.global_order) or refuses; a sharded
            # model is resharded from every rank's part (engine.distributed.reshard).
            return loaded
        tensors_file, header_file = state_parts.rank_files(rank)
        if tensors_file not in loaded.extra_files or header_file not in loaded.extra_files:
            raise CheckpointCorrupt(f"{name}: the part of rank {rank} ({header_file}) is missing")
        from engine.checkpoint.format.codec import decode_state
        part = decode_state(bytes(loaded.extra_files[header_file]), loaded.extra_files[tensors_file])
        return dataclasses.replace(loaded, state=state_parts.with_rank_part(name, loaded.state, part))

    # ---- saving -------------------------------------------------------------------------
    def encode(self, state: dict[str, Any], progress_bytes: bytes) -> tuple[EncodedState, dict[str, int]]:
        """What this rank writes (rank 0: the whole tree; others: their per-rank part) and the
        digest of its replicated state."""
        digest = state_parts.replicated_digest(state, progress_bytes)
        written = state if self.is_writer else state_parts.rank_part(state)
        return encode_state(written), digest

    # ---- the Committer of one rank (engine.checkpoint.store.request) ----------------------------
    @property
    def commits(self) -> bool:
        """Rank 0 commits; the other ranks write their parts."""
        return self.is_writer

    def prepare(self, store: CheckpointStore, request: CommitRequest) -> CommitRequest:
        """Take the next agreed sequence and the staging directory every rank writes into."""
        sequence = self._next_sequence
        self._next_sequence += 1
        staging = f"tmp-{sequence:010d}-{self.context.attempt}" if store.storage.rename_is_atomic else checkpoint_name(sequence)
        self._round = _Round(staging)
        return dataclasses.replace(request, sequence=sequence, staging=staging)

    def write(self, store: CheckpointStore, pending: PendingCheckpoint, request: CommitRequest,
              callbacks: CommitCallbacks) -> str:
        """Rank 0: write the main files, gather the other ranks' parts, commit. Other ranks:
        write this rank's part, report it, and return the outcome rank 0 announces."""
        assert request.sequence is not None and request.staging is not None, "prepare() first"
        if self.is_writer:
            return self._commit_as_writer(store, pending, request, callbacks)
        name = checkpoint_name(request.sequence)
        report = self._write_rank_part(store, pending, callbacks, f"{CHECKPOINT_DIR}/{request.staging}")
        self._gather(report)
        outcome = self._announce(None)
        if outcome != name:
            raise _outcome_error(outcome)
        return name

    def settle(self, store: CheckpointStore, outcome: str | BaseException) -> None:
        """Rank 0: announce the outcome to every rank; after a failure, first the gather the
        other ranks wait in (when it did not happen) and the removal of the staging directory."""
        round_ = self._round
        if isinstance(outcome, BaseException):
            if not round_.gathered:
                self._gather(_PartReport({}, {}, "rank 0 failed first"))
            store.discard_staging(round_.staging)
            self._announce(f"error: {type(outcome).__name__}: {outcome}")
            return
        self._announce(outcome)

    def _write_rank_part(self, store: CheckpointStore, pending: PendingCheckpoint, callbacks: CommitCallbacks,
                         directory: str) -> _PartReport:
        storage = store.storage
        tensors_file, header_file = state_parts.rank_files(self.context.rank)
        release = callbacks.on_data_written or (lambda: None)
        try:
            storage.makedirs(directory)
            records = {}
            for file_name, chunks in ((tensors_file, pending.encoded.tensor_chunks()),
                                      (header_file, [pending.encoded.header])):
                records[file_name] = storage.write(f"{directory}/{file_name}", chunks, durable=False)
            release()
            storage.sync([f"{directory}/{file_name}" for file_name in records])
        except OSError as error:
            return _PartReport({}, pending.digest or {}, f"rank {self.context.rank}: {type(error).__name__}: {error}")
        finally:
            release()
        return _PartReport(records, pending.digest or {}, None)

    def _commit_as_writer(self, store: CheckpointStore, pending: PendingCheckpoint, request: CommitRequest,
                          callbacks: CommitCallbacks) -> str:
        staged = store.stage(request, callbacks)
        try:
            self._round.gathered = True
            parts = self._check_reports(self._gather(_PartReport({}, pending.digest or {}, None)))
        except BaseException:
            staged.discard()
            raise
        return staged.commit(parts)

    def _check_reports(self, reports: list[_PartReport]) -> dict[str, FileRecord]:
        failed = [report.error for report in reports[1:] if report.error is not None]
        if failed:
            raise CheckpointWriteError("a rank could not write its part of the checkpoint: " + "; ".join(failed))
        self._check_digests(reports)
        records: dict[str, FileRecord] = {}
        for rank, report in enumerate(reports[1:], start=1):
            expected = set(state_parts.rank_files(rank))
            if set(report.records) != expected:
                raise CheckpointWriteError(f"rank {rank} reported files {sorted(report.records)}, expected {sorted(expected)}")
            records.update({file_name: FileRecord(size, crc) for file_name, (size, crc) in report.records.items()})
        return records

    @staticmethod
    def _check_digests(reports: list[_PartReport]) -> None:
        """ReplicaDivergence when the ranks' replicated states differ."""
        differing = state_parts.differences([report.digest for report in reports])
        if differing:
            raise ReplicaDivergence(
                "the replicated state differs between ranks, so the checkpoint is not committed: "
                + "; ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
                + ". Every rank must apply the same updates (DDP-synced gradients, same optimizer settings); "
                "the newest committed checkpoint is the last agreed state")

    def _gather(self, report: _PartReport) -> list[_PartReport]:
        as_plain = (report.records, report.digest, report.error, report.memory_error)
        received: list[Any] | None = [None] * self.context.world_size if self.is_writer else None
        # A writer thread's wait flags the word; on the fit's thread (writer="sync") the phase stays
        # `checkpoint` (watchdog.waiting_for_peers).
        with watchdog.waiting_for_peers(on_the_fits_thread=False):
            dist.gather_object(as_plain, received, dst=0, group=self.context.writer_group)
        if received is None:
            return []
        return [_PartReport(dict(records), dict(digest), error, memory_error)
                for records, digest, error, memory_error in received]

    def _announce(self, outcome: str | None) -> str:
        message = [outcome]
        with watchdog.waiting_for_peers(on_the_fits_thread=False):
            dist.broadcast_object_list(message, src=0, group=self.context.writer_group)
        return str(message[0])


def _outcome_error(outcome: str) -> CheckpointError:
    if "ReplicaDivergence" in outcome:
        return ReplicaDivergence(f"rank 0 did not commit the checkpoint: {outcome}")
    return CheckpointWriteError(f"rank 0 did not commit the checkpoint: {outcome}")
