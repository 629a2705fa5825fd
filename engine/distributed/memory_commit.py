"""Memory-first checkpoints of a torchrun job: every rank's part in node memory, a verified copy
on a peer node, a durable commit now and then.

With ``CheckpointConfig(local_tier=PATH)`` under torchrun, :class:`MemoryFirstCommit` replaces
:class:`~engine.distributed.commit.GroupCommit` as each rank's committer. For each checkpoint,
in the same order on every rank (in the writer thread):

1. the rank commits its part into its node's memory tier (engine.checkpoint.tiers.node): rank 0
   the main files, rank r > 0 its per-rank files, the very bytes a durable checkpoint holds;
2. with ``peer_copies=1``, every rank sends its part to the same local rank on the next node (a
   ring over nodes) and receives the part of the same local rank on the previous node, which it
   verifies against the part's manifest before keeping it;
3. when the checkpoint is due in the run dir (``durable_every_*``, a preemption's, the last
   one), the ranks also write it there as :class:`GroupCommit` does;
4. each rank reports to rank 0 (one gather on the writer group): its part, its copy, its
   replicated-state digest; rank 0 announces the checkpoint complete when every part and copy
   is in place and the digests agree (and commits the durable one), or failed;
5. only after a checkpoint is announced complete does a rank delete its older parts and copies
   (so a common complete checkpoint always survives); after a failure it deletes this one's.

A restart assembles the newest checkpoint every rank can get exactly (:meth:`select`): the ranks
gather what each holds, rank by rank a part comes from its own tier or from the peer that keeps
a copy of it (sent back, verified, and kept again: a node that comes back empty is refilled),
and a checkpoint newer than the durable tier's newest is loaded when every part verifies; a copy
that does not is reported and left out, and the next one is tried. Otherwise the durable tier's
choice stands (GroupCommit.select).

Placement: the copy of rank r's part lives on rank ``(r + local_world_size) % world_size``, on the
next node. One node lost (its tier gone) is survived: its ranks' parts come back from the next
node. Two adjacent nodes lost together are not: the job resumes from the durable tier.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine import faults, watchdog
from engine.checkpoint.format.codec import decode_state
from engine.checkpoint.format.names import checkpoint_name
from engine.checkpoint.format.rank_parts import saved_world_size
from engine.checkpoint.format.state_keys import SIGNATURE
from engine.checkpoint.store.catalogue import LoadedCheckpoint, StateValidator
from engine.checkpoint.store.checkpoint_store import CHECKPOINT_DIR, CheckpointStore
from engine.checkpoint.store.request import CheckpointFiles, CommitCallbacks, CommitRequest
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.tiers.node import NodeTier, RankTier
from engine.checkpoint.writers.pending import PendingCheckpoint
from engine.distributed import byte_transfer, state_parts
from engine.distributed.commit import GroupCommit, _outcome_error, _PartReport
from engine.distributed.environment import DistributedContext
from engine.errors import CheckpointError, CheckpointWriteError, ConfigError
from progress import ProgressSchemaError, decode_tree


def local_world_size(context: DistributedContext) -> int:
    """Ranks per node (torchrun's LOCAL_WORLD_SIZE; the whole job when unset)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    size = int(value) if value.isdigit() and int(value) > 0 else context.world_size
    if context.world_size % size:
        raise ConfigError(f"CheckpointConfig.local_tier: the world size {context.world_size} is not a multiple of "
                          f"LOCAL_WORLD_SIZE={size}; every node must run as many ranks")
    return size


@dataclasses.dataclass(frozen=True)
class PeerRing:
    """Where copies go: the same local rank on the next node."""

    world_size: int
    per_node: int

    def keeper_of(self, rank: int) -> int:
        """The rank that keeps the copies of ``rank``'s parts."""
        return (rank + self.per_node) % self.world_size

    def kept_by_me(self, rank: int) -> int:
        """The rank whose copies ``rank`` keeps."""
        return (rank - self.per_node) % self.world_size


def peer_ring(context: DistributedContext, peer_copies: int) -> PeerRing | None:
    """The ring of peer copies (None without); ConfigError on a job of one node."""
    if peer_copies == 0:
        return None
    per_node = local_world_size(context)
    if context.world_size // per_node < 2:
        raise ConfigError(f"CheckpointConfig.peer_copies={peer_copies} keeps each rank's part on another node, "
                          f"but this job runs on one node ({context.world_size} rank(s), LOCAL_WORLD_SIZE={per_node}); "
                          "set peer_copies=0 on one node")
    return PeerRing(context.world_size, per_node)


@dataclasses.dataclass
class _MemoryRound:
    sequence: int = -1
    # What failed in this rank's memory tier (None: nothing).
    error: str | None = None
    # Announced by rank 0: every part and copy of the round is in memory.
    complete: bool = False


def memory_first_commit(context: DistributedContext, local_tier: str, peer_copies: int, run_storage: Storage,
                        keep: int) -> MemoryFirstCommit:
    """This rank's committer with a memory tier under ``local_tier`` (``keep`` complete parts
    per directory)."""
    ring = peer_ring(context, peer_copies)
    holds_for = None if ring is None else ring.kept_by_me(context.rank)
    return MemoryFirstCommit(context, NodeTier(local_tier, run_storage, context.rank, holds_for, keep), ring)


class MemoryFirstCommit(GroupCommit):
    """One rank's commits and restore with a memory tier (see the module docstring)."""

    def __init__(self, context: DistributedContext, node: NodeTier, ring: PeerRing | None) -> None:
        super().__init__(context)
        self._node = node
        self._ring = ring
        self._generation = 0
        self._memory = _MemoryRound()

    @property
    def node_tier(self) -> NodeTier:
        return self._node

    # ---- start --------------------------------------------------------------------------
    def after_acquire(self, store: CheckpointStore) -> None:
        """Rank 0 holds the lease and has bound its tier to it: every rank binds its own
        directories to the same writer generations, and the first sequence is above every
        part any rank holds (a sequence is never written twice)."""
        values: list[Any] = [0, 0, 0]
        if self.is_writer:
            assert self._node.lease is not None, "the tiering claims rank 0's tier first"
            values = [store.next_sequence(), *self._node.lease]
        dist.broadcast_object_list(values, src=0, group=self.context.writer_group)
        first, previous_generation, generation = (int(value) for value in values)
        if not self.is_writer:
            self._node.claim(previous_generation, generation)
        self._generation = generation
        highest = torch.tensor([max(first, self._node.newest_sequence() + 1)], dtype=torch.int64)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=self.context.writer_group)
        self._next_sequence = int(highest.item())

    def handover(self) -> dict[str, Any]:
        """What a writer process needs to commit into this rank's memory tier (see GroupCommit)."""
        node = self._node
        return {**super().handover(), "local_tier": node.root, "keep": node.keep,
                "peer_copies": 0 if self._ring is None else 1, "generation": self._generation}

    def take_over(self, handed: dict[str, Any]) -> None:
        """Commit from where ``handed`` says, into the tier directories the training process
        claimed for this writer generation (claimed again here: kept, as their marker names it)."""
        super().take_over(handed)
        self._generation = int(handed["generation"])
        self._node.claim(self._generation, self._generation)

    # ---- saving -------------------------------------------------------------------------
    def write(self, store: CheckpointStore, pending: PendingCheckpoint, request: CommitRequest,
              callbacks: CommitCallbacks) -> str:
        assert request.sequence is not None and request.staging is not None, "prepare() first"
        self._memory = _MemoryRound(request.sequence)
        self._memory.error = self._write_to_memory(pending, request)
        if not pending.durable and callbacks.on_data_written is not None:
            callbacks.on_data_written()  # the snapshot's bytes are in memory: its buffers are free
        if self.is_writer:
            return self._commit_as_writer(store, pending, request, callbacks)
        name = checkpoint_name(request.sequence)
        if pending.durable:
            report = self._write_rank_part(store, pending, callbacks, f"{CHECKPOINT_DIR}/{request.staging}")
        else:
            report = _PartReport({}, pending.digest or {}, None)
        report.memory_error = self._memory.error
        self._gather(report)
        outcome = self._announce(None)
        self._after_outcome()
        if outcome != name:
            raise _outcome_error(outcome)
        return name

    def _write_to_memory(self, pending: PendingCheckpoint, request: CommitRequest) -> str | None:
        """This rank's part into its tier, then the peer copies; what failed (None: nothing)."""
        rank, sequence = self.context.rank, request.sequence
        assert sequence is not None
        error: str | None = None
        files = CheckpointFiles.of_state(pending.encoded, pending.progress_bytes)
        try:
            self._node.own.write(files, sequence, self._generation, request)
        except (OSError, CheckpointError) as failure:
            error = f"rank {rank}: its part in the memory tier {self._node.own.url}: {type(failure).__name__}: {failure}"
        if self._ring is None:
            return error
        outgoing: byte_transfer.OutgoingPart | None = None
        if error is None:
            # The bytes just written, from the snapshot's buffers; the receiver verifies them.
            outgoing = (self._node.own.manifest_of(sequence), list(files.contents.items()))
        faults.reach("memory_tier_peer_copy")
        with watchdog.waiting_for_peers():  # a peer that never answers is the one named
            received = byte_transfer.exchange_part(outgoing, self._ring.keeper_of(rank), self._ring.kept_by_me(rank),
                                                   self.context.writer_group)
        owner = self._ring.kept_by_me(rank)
        if received is None:
            return error or f"rank {rank}: rank {owner} sent no copy of its part"
        try:
            assert self._node.held is not None
            manifest = self._node.held.keep(*received)
            if manifest.sequence != sequence:
                raise CheckpointWriteError(f"received sequence {manifest.sequence}, expected {sequence}")
        except (OSError, CheckpointError) as failure:
            return error or f"rank {rank}: the copy of rank {owner}'s part: {type(failure).__name__}: {failure}"
        return error

    def _commit_as_writer(self, store: CheckpointStore, pending: PendingCheckpoint, request: CommitRequest,
                          callbacks: CommitCallbacks) -> str:
        staged = store.stage(request, callbacks) if pending.durable else None
        try:
            self._round.gathered = True
            reports = self._gather(_PartReport({}, pending.digest or {}, None, self._memory.error))
            missing = [report.memory_error for report in reports if report.memory_error is not None]
            if staged is None:  # a memory-only round: it is the checkpoint
                if missing:
                    raise CheckpointWriteError("the checkpoint is not complete in the memory tier: " + "; ".join(missing))
                self._check_digests(reports)
                parts = {}
            else:
                parts = self._check_reports(reports)
        except BaseException:
            if staged is not None:
                staged.discard()
            raise
        self._memory.complete = not missing
        if staged is None:
            return checkpoint_name(request.sequence or 0)
        name = staged.commit(parts)
        if missing:  # durable all the same; a restart after it starts from the run dir
            warnings.warn(f"{name} is in the run dir but not complete in the memory tier: " + "; ".join(missing),
                          stacklevel=2)
        return name

    def settle(self, store: CheckpointStore, outcome: str | BaseException) -> None:
        if isinstance(outcome, BaseException):
            self._memory.complete = False
        super().settle(store, outcome)
        self._after_outcome()

    def _announce(self, outcome: str | None) -> str:
        """Rank 0's outcome, and whether the round is complete in the memory tier."""
        message = [outcome, self._memory.complete]
        with watchdog.waiting_for_peers(on_the_fits_thread=False):
            dist.broadcast_object_list(message, src=0, group=self.context.writer_group)
        self._memory.complete = bool(message[1])
        return str(message[0])

    def _after_outcome(self) -> None:
        """After the announcement: keep the newest parts complete in memory, or drop this round's."""
        sequence, complete = self._memory.sequence, self._memory.complete
        for tier in self._node.tiers():
            try:
                if complete:
                    tier.retain(self._node.keep, sequence)
                else:
                    tier.discard(sequence)
            except OSError as error:
                warnings.warn(f"memory tier {tier.url}: could not clean up: {error}", stacklevel=2)

    # ---- restoring ----------------------------------------------------------------------
    def select(self, choose: Callable[[], LoadedCheckpoint | None], store: CheckpointStore,
               validate: StateValidator, newest_wanted: bool = False) -> LoadedCheckpoint | None:
        """The newest checkpoint every rank can assemble from the memory tier when it is newer
        than the durable tier's (``newest_wanted``: resume="auto"/"latest"), else the durable
        tier's choice."""
        if newest_wanted:
            loaded = self._from_memory(store, validate)
            if loaded is not None:
                return loaded
        return super().select(choose, store, validate)

    def _from_memory(self, store: CheckpointStore, validate: StateValidator) -> LoadedCheckpoint | None:
        mine = self._node.inventory()
        mine["durable"] = [store.newest_committed_sequence() if self.is_writer else -1]
        everyone: list[Any] = [None] * self.context.world_size
        dist.all_gather_object(everyone, mine, group=self.context.writer_group)
        excluded: set[tuple[int, int, int]] = set()
        while True:
            choice = self._choose(everyone, excluded)
            if choice is None:
                return None
            sequence, sources = choice
            loaded, bad, unusable = self._assemble(sequence, sources, validate)
            flags: list[Any] = [None] * self.context.world_size
            dist.all_gather_object(flags, (bad, unusable), group=self.context.writer_group)
            if any(flag[1] for flag in flags):
                return None  # another world size, or a state this run cannot take: the durable tier decides
            failed = [tuple(flag[0]) for flag in flags if flag[0] is not None]
            if not failed:
                assert loaded is not None
                return loaded
            excluded.update((rank, source, sequence) for rank, source in failed)

    def _choose(self, everyone: list[Any], excluded: set[tuple[int, int, int]]) -> tuple[int, dict[int, int]] | None:
        """The newest sequence above the durable tier's newest for which every rank's part has a
        source (itself first, then the peer that keeps its copies) not yet found bad."""
        durable = int(everyone[0]["durable"][0])
        ring = self._ring
        candidates = sorted({sequence for entry in everyone for sequence in entry["own"]}, reverse=True)
        for sequence in candidates:
            if sequence <= durable:
                return None
            sources: dict[int, int] = {}
            for rank in range(self.context.world_size):
                options = [rank] if sequence in everyone[rank]["own"] else []
                if ring is not None and sequence in everyone[ring.keeper_of(rank)]["held"]:
                    options.append(ring.keeper_of(rank))
                usable = [source for source in options if (rank, source, sequence) not in excluded]
                if not usable:
                    break
                sources[rank] = usable[0]
            else:
                return sequence, sources
        return None

    def _read_part(self, rank: int, source: int, sequence: int) -> bytes | None:
        """On ``source``: rank ``rank``'s part of ``sequence``, packed, verified (None: it does
        not verify, reported here)."""
        tier: RankTier | None = self._node.own if source == rank else self._node.held
        assert tier is not None
        try:
            return byte_transfer.pack_part(*tier.read(sequence))
        except (OSError, CheckpointError) as error:
            warnings.warn(f"memory tier: the part of rank {rank} of {checkpoint_name(sequence)} in {tier.url} "
                          f"is not loaded: {type(error).__name__}: {error}", stacklevel=3)
            return None

    def _assemble(self, sequence: int, sources: dict[int, int],
                  validate: StateValidator) -> tuple[LoadedCheckpoint | None, tuple[int, int] | None, bool]:
        """Every rank takes rank 0's part (the main files) and its own; (the checkpoint, the
        (rank, source) of a part that did not verify, whether the memory tier cannot serve this run)."""
        rank, group = self.context.rank, self.context.writer_group
        main_source = sources[0]
        packed_main = self._read_part(0, main_source, sequence) if rank == main_source else None
        packed_main = byte_transfer.broadcast(packed_main, main_source, group)
        bad: tuple[int, int] | None = None if packed_main is not None else (0, main_source)
        own_packed = packed_main if rank == 0 else None
        for owner in range(1, self.context.world_size):
            source = sources[owner]
            if source == owner:
                if rank == owner:
                    own_packed = self._read_part(owner, owner, sequence)
            elif rank == source:
                byte_transfer.send(self._read_part(owner, source, sequence), owner, group)
            elif rank == owner:
                own_packed = byte_transfer.receive(source, group)
        if bad is not None:
            return None, bad, False
        if own_packed is None:
            return None, (rank, sources[rank]), False
        try:
            main_manifest, main = byte_transfer.unpack_part(packed_main)  # type: ignore[arg-type]
            own_manifest, own = byte_transfer.unpack_part(own_packed)
            if sources[rank] != rank:  # refill this node's tier from the peer's copy (verified on the way)
                faults.reach("memory_tier_refill")
                self._node.own.keep(own_manifest, own)
            if rank == 0:
                main_manifest, main = own_manifest, own
            loaded = self._loaded(sequence, main_manifest, main, own, validate)
        except _Unusable:
            return None, None, True
        except (OSError, CheckpointError) as error:
            warnings.warn(f"memory tier: {checkpoint_name(sequence)} of rank {rank} is not loaded: "
                          f"{type(error).__name__}: {error}", stacklevel=2)
            return None, (rank, sources[rank]), False
        return loaded, None, False

    def _loaded(self, sequence: int, manifest_bytes: bytes, main: dict[str, bytearray], own: dict[str, bytearray],
                validate: StateValidator) -> LoadedCheckpoint:
        from engine.checkpoint.format.manifest import Manifest, verify_file
        from engine.errors import CheckpointCorrupt

        name = checkpoint_name(sequence)
        manifest = Manifest.from_json(manifest_bytes)
        for file_name, record in manifest.files.items():
            if file_name not in main:
                raise CheckpointCorrupt(f"{name}: {file_name} is missing")
            verify_file(file_name, main[file_name], record)
        try:
            progress = decode_tree(bytes(main["progress.msgpack"]))
        except ProgressSchemaError as error:
            raise CheckpointCorrupt(f"{name}: progress.msgpack: {error}") from error
        state = decode_state(bytes(main["state.msgpack"]), main["tensors.bin"])
        signature = state.get(SIGNATURE) if isinstance(state, dict) else None
        if not isinstance(signature, dict) or saved_world_size(signature) != self.context.world_size:
            raise _Unusable()
        validate(name, state)
        loaded = LoadedCheckpoint(name, manifest, progress, state)
        if self.context.rank == 0:
            return loaded
        tensors_file, header_file = state_parts.rank_files(self.context.rank)
        extra = {tensors_file: own["tensors.bin"], header_file: own["state.msgpack"]}
        return self._own_part(dataclasses.replace(loaded, extra_files=extra))


class _Unusable(Exception):
    """The memory tier's checkpoint was written by another world size."""
