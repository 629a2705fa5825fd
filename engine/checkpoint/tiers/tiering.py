"""One checkpoint tier (the run dir) or two (a fast node-local tier in front of it).

:class:`RunCheckpointer` (engine.checkpoint.policy) chooses one :class:`Tiering` at construction
(:func:`choose_tiering`) and never asks which it holds. The tiering answers which stores resume
reads, where a snapshot is written, which checkpoints must reach the durable tier, and what to
close and release at the end. :class:`TwoTiers` wraps the fast tier's directory
(:class:`~engine.checkpoint.tiers.fast.FastTier`) and, once the run starts, its writer
(:class:`~engine.checkpoint.tiers.fast.TierWriter`, with its durable promoter); see
engine.checkpoint.tiers.fast for the protocol.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Protocol

from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.lease import WriterLease
from engine.checkpoint.store.retention import Retention
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.tiers.fast import FastTier, TierWriter
from engine.checkpoint.tiers.node import NodeTier
from engine.checkpoint.writers.protocol import FastTierCommits
from engine.checkpoint.writers.worker import BackgroundWork


class Closer(Protocol):
    """Something whose pending work :meth:`RunCheckpointer.close` waits for."""

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class TierPlan:
    """The tiers' part of a run's plan (engine.checkpoint.plan): one tier (``local_tier`` None),
    or a fast tier in front of the run dir and how often checkpoints reach the run dir."""

    local_tier: str | None
    durable_every_n_splits: int | None
    durable_every_seconds: float | None
    # Under torchrun: copies of each rank's memory parts kept on another node (0 or 1).
    peer_copies: int = 0


class Tiering(Protocol):
    """Where a run's checkpoints live; see the module docstring."""

    def claim(self, lease: WriterLease) -> None:
        """The writer lease was just taken: bind the tiers to this writer."""

    def takeover_sequence(self, durable_sequence: int, lease: WriterLease) -> int:
        """The takeover fence: the highest sequence committed, given the run dir's."""

    def stores(self) -> list[CheckpointStore]:
        """The stores resume reads, the run dir's first."""

    def holds_durably(self, name: str) -> bool:
        """Whether checkpoint ``name`` (the one resumed from) is in the durable tier."""

    def start(self, retention: Retention, also_sync: Callable[[], list[str]], lease: WriterLease,
              units_completed: int) -> FastTierCommits | None:
        """The run's writer starts (after any resume), at ``units_completed``: the fast tier it
        commits to first (None: one tier)."""

    @property
    def makes_newest_durable_at_close(self) -> bool:
        """Whether closing makes the newest checkpoint durable (else the run's end saves its
        boundary again when the last checkpoint was not durable)."""

    def background_work(self) -> BackgroundWork | None:
        """What tells whether the tiers' own background work overlapped a split (None: none)."""

    def durable_due(self, units_completed: int, force: bool) -> bool:
        """Whether the checkpoint saved now must reach the durable tier."""

    def saved(self, durable_written: bool, units_completed: int) -> None:
        """A save ended; ``durable_written``: it was written and goes to the durable tier."""

    def check(self) -> None:
        """Raise, on the training thread, an error the tiers' background work met."""

    def closers(self) -> list[Closer]:
        """What to close after the writer (once: a second call returns nothing)."""

    def release(self) -> None:
        """Let another run use what this one held."""


class SingleTier:
    """Every checkpoint is written to the run dir, and durable."""

    makes_newest_durable_at_close = True

    def __init__(self, durable: CheckpointStore) -> None:
        self._durable = durable

    def claim(self, lease: WriterLease) -> None:
        pass

    def takeover_sequence(self, durable_sequence: int, lease: WriterLease) -> int:
        return durable_sequence

    def stores(self) -> list[CheckpointStore]:
        return [self._durable]

    def holds_durably(self, name: str) -> bool:
        return True

    def start(self, retention: Retention, also_sync: Callable[[], list[str]], lease: WriterLease,
              units_completed: int) -> FastTierCommits | None:
        return None

    def background_work(self) -> BackgroundWork | None:
        return None

    def durable_due(self, units_completed: int, force: bool) -> bool:
        return True

    def saved(self, durable_written: bool, units_completed: int) -> None:
        pass

    def check(self) -> None:
        pass

    def closers(self) -> list[Closer]:
        return []

    def release(self) -> None:
        pass


class DurableSchedule:
    """When a checkpoint of a fast tier must also reach the run dir: every
    ``durable_every_n_splits`` splits / ``durable_every_seconds``, and forced ones always."""

    def __init__(self, plan: TierPlan) -> None:
        self._every_n_splits = plan.durable_every_n_splits
        self._every_seconds = plan.durable_every_seconds
        self._last_durable_time = time.monotonic()
        self._units_at_last_durable = 0

    def schedule_from(self, units_completed: int) -> None:
        """The run's writer starts at ``units_completed``."""
        self._units_at_last_durable = units_completed

    def durable_due(self, units_completed: int, force: bool) -> bool:
        """Forced ones (the last of a run, a preemption's) always are."""
        if force:
            return True
        every = self._every_n_splits
        if every is not None and units_completed // every > self._units_at_last_durable // every:
            return True
        return self._every_seconds is not None and time.monotonic() - self._last_durable_time >= self._every_seconds

    def saved(self, durable_written: bool, units_completed: int) -> None:
        if durable_written:
            self._last_durable_time = time.monotonic()
            self._units_at_last_durable = units_completed


class TwoTiers(DurableSchedule):
    """Every checkpoint goes to the fast tier; every ``durable_every_n_splits`` splits /
    ``durable_every_seconds`` (and forced and candidate best ones always) also to the run dir."""

    makes_newest_durable_at_close = True  # the tier writer's close copies it

    def __init__(self, plan: TierPlan, local_tier: str, storage: Storage, durable: CheckpointStore) -> None:
        super().__init__(plan)
        self._fast = FastTier(local_tier, storage)
        self._durable = durable
        self._writer: TierWriter | None = None

    def claim(self, lease: WriterLease) -> None:
        self._fast.claim(lease.previous_generation, lease.generation)

    def takeover_sequence(self, durable_sequence: int, lease: WriterLease) -> int:
        """With the fast tier's when it holds the previous writer's checkpoints (a candidate
        best one among them is copied into the run dir by this writer)."""
        return max(durable_sequence, self._fast.newest_sequence_of(lease.previous_generation))

    def stores(self) -> list[CheckpointStore]:
        """The run dir, then the fast tier when its fence matches."""
        return [self._durable, self._fast.store] if self._fast.usable else [self._durable]

    def holds_durably(self, name: str) -> bool:
        return name in self._durable.committed_names()

    def start(self, retention: Retention, also_sync: Callable[[], list[str]], lease: WriterLease,
              units_completed: int) -> FastTierCommits | None:
        self.schedule_from(units_completed)
        self._writer = TierWriter(self._fast.store, self._durable, retention, also_sync, lease.verify, lease.generation)
        return self._writer

    def background_work(self) -> BackgroundWork | None:
        """The copies into the durable tier (they compete with training)."""
        return None if self._writer is None else self._writer.promoter.copied_since

    def check(self) -> None:
        if self._writer is not None:
            self._writer.check()

    def closers(self) -> list[Closer]:
        """The tier writer: the fast tier's newest checkpoint reaches the durable tier."""
        writer, self._writer = self._writer, None
        return [] if writer is None else [writer]

    def release(self) -> None:
        self._fast.release()


class GroupTiers(DurableSchedule):
    """A torchrun job's memory tier (engine.checkpoint.tiers.node): each rank's committer
    (engine.distributed.memory_commit) writes every checkpoint's parts into node memory and, when
    this schedule says so, into the run dir too; the run dir's store is the only one resume
    reads here (the committer assembles memory checkpoints itself)."""

    makes_newest_durable_at_close = False  # a collective: the run's end saves again instead

    def __init__(self, plan: TierPlan, node: NodeTier, durable: CheckpointStore) -> None:
        super().__init__(plan)
        self._node = node
        self._durable = durable

    def claim(self, lease: WriterLease) -> None:
        """Rank 0 binds its directories to the lease (the other ranks, once it tells them)."""
        self._node.claim(lease.previous_generation, lease.generation)

    def takeover_sequence(self, durable_sequence: int, lease: WriterLease) -> int:
        return max(durable_sequence, self._node.newest_sequence())

    def stores(self) -> list[CheckpointStore]:
        return [self._durable]

    def holds_durably(self, name: str) -> bool:
        return name in self._durable.committed_names()

    def start(self, retention: Retention, also_sync: Callable[[], list[str]], lease: WriterLease,
              units_completed: int) -> FastTierCommits | None:
        self.schedule_from(units_completed)
        return None

    def background_work(self) -> BackgroundWork | None:
        return None

    def check(self) -> None:
        pass

    def closers(self) -> list[Closer]:
        return []

    def release(self) -> None:
        self._node.close()


def choose_tiering(plan: TierPlan, storage: Storage, durable: CheckpointStore, node: NodeTier | None = None) -> Tiering:
    """The tiering ``plan`` asks for (``node``: a torchrun rank's memory tier)."""
    if plan.local_tier is None:
        return SingleTier(durable)
    if node is not None:
        return GroupTiers(plan, node, durable)
    return TwoTiers(plan, plan.local_tier, storage, durable)
