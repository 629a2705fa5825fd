"""The choice of a run's writer (engine.checkpoint.writers.protocol.Writer), made once.

A run's checkpointer (engine.checkpoint.policy.RunCheckpointer) asks :func:`choose_writer` for
the kind of writer the configuration names, once, when it is built. The kind may start work as
soon as the writer lease is held (:meth:`WriterKind.launch`: a writer process starts while the
run resumes) and builds the writer, its fast tier given, once the run starts
(:meth:`WriterKind.build`). Nothing outside this room asks which writer it holds.

Adding a writer: a module of this room with its class (and, where it starts work early, its
kind), and one line in :data:`WRITER_KINDS`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:  # the writers themselves are imported when one is built: the configuration
    # checks a writer's name against WRITER_KINDS without importing torch
    from engine.checkpoint.store.checkpoint_store import CheckpointStore
    from engine.checkpoint.store.lease import WriterLease
    from engine.checkpoint.store.metrics_log import MetricsLog
    from engine.checkpoint.store.retention import Retention
    from engine.checkpoint.store.storage import Storage
    from engine.checkpoint.writers.committer import Committer
    from engine.checkpoint.writers.process.writer import LaunchedWriter
    from engine.checkpoint.writers.protocol import FastTierCommits, Writer


@dataclasses.dataclass(frozen=True)
class WriterParts:
    """What a writer is built from (engine.checkpoint.policy.RunCheckpointer.start)."""

    store: CheckpointStore
    storage: Storage
    lease: WriterLease
    retention: Retention
    # The other files made durable with each checkpoint (metrics.jsonl on a local run dir).
    also_sync: Callable[[], list[str]]
    metrics: MetricsLog
    # How this process takes part in a commit (None: alone; a torchrun rank: its group).
    committer: Committer | None
    # The fast tier in front of the run dir (None: one tier).
    tier: FastTierCommits | None
    max_in_flight: int
    when_behind: str
    # A wait for a writer that hangs past the watchdog's deadline abandons the checkpoint it is
    # stuck in and replaces the writer (on_io_error="warn" in a process alone), instead of the
    # watchdog's hang exit (docs/faults.md, "A hung writer").
    abandon_hung: bool = False
    # A torchrun rank: what its writer process joins the other ranks' with (RankGroup.
    # writer_process_spec; called once the start is agreed). None in a process alone.
    group_spec: Callable[[], dict[str, Any]] | None = None


class WriterKind(Protocol):
    """One kind of writer: how it starts and how it is built (see the module docstring)."""

    # Whether it hands commits to another process (the lease records it, engine.checkpoint.store.lease).
    uses_process: bool

    def launch(self, storage: Storage, lease: WriterLease) -> None:
        """The writer lease is held: start what can start before the run resumes."""
        ...

    def build(self, parts: WriterParts) -> Writer:
        """The run's writer, once the run starts."""
        ...

    def abandon(self) -> None:
        """The run ends without building the writer: let go of what :meth:`launch` started."""
        ...


class _InProcess:
    """A writer of the training process: synchronous, or a background thread."""

    uses_process = False

    def __init__(self, build: Callable[[WriterParts], Writer]) -> None:
        self.build = build

    def launch(self, storage: Storage, lease: WriterLease) -> None:
        pass

    def abandon(self) -> None:
        pass


class _WriterProcess:
    """A writer process (engine.checkpoint.writers.process), started as soon as the lease is
    held (engine.checkpoint.plan refuses it where it cannot write yet)."""

    uses_process = True

    def __init__(self) -> None:
        self._launched: LaunchedWriter | None = None

    def launch(self, storage: Storage, lease: WriterLease) -> None:
        from engine.checkpoint.writers.process.writer import LaunchedWriter
        self._launched = LaunchedWriter(lease)

    def build(self, parts: WriterParts) -> Writer:
        from engine.checkpoint.writers.process.writer import ProcessWriter
        assert self._launched is not None, "launch() before build()"
        group = None if parts.group_spec is None else parts.group_spec()  # (refused: abandon() lets it go)
        launched, self._launched = self._launched, None
        return ProcessWriter(launched, parts.storage, parts.lease, parts.retention, parts.metrics,
                             parts.max_in_flight, parts.when_behind, parts.abandon_hung, group)

    def abandon(self) -> None:
        launched, self._launched = self._launched, None
        if launched is not None:  # the run ended before its writer process was given anything
            launched.abandon()


def _synchronous(parts: WriterParts) -> Writer:
    from engine.checkpoint.writers.writer import SyncWriter
    return SyncWriter(parts.store, parts.lease, parts.retention, parts.also_sync, parts.committer, parts.metrics,
                      parts.tier)


def _thread(parts: WriterParts) -> Writer:
    from engine.checkpoint.writers.writer import BackgroundWriter
    return BackgroundWriter(parts.store, parts.lease, parts.retention, parts.also_sync, parts.max_in_flight,
                            parts.when_behind, parts.committer, parts.metrics, parts.tier, parts.abandon_hung)


# Each kind of writer, by the name the configuration gives it (CheckpointConfig.writer).
WRITER_KINDS: dict[str, Callable[[], WriterKind]] = {
    "sync": lambda: _InProcess(_synchronous),
    "thread": lambda: _InProcess(_thread),
    "process": _WriterProcess,
}


def choose_writer(kind: str) -> WriterKind:
    """The writer ``kind`` names (a key of :data:`WRITER_KINDS`, checked by engine.checkpoint.plan)."""
    return WRITER_KINDS[kind]()
