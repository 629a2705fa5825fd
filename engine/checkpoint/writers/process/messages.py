"""The typed messages from a training process to its writer process: records whose
``to_dict`` / ``from_dict`` come from their fields (as the progress records of ``progress/``),
each carrying its kind and :data:`MESSAGE_VERSION`. engine.checkpoint.writers.process.channel
frames them; nothing builds one by hand on one side and reads it back by key on the other.

Torch-free: the writer process imports this module.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar

from engine.errors import CheckpointWriteError

# Bumped when a message's fields change (a training process and its writer process always run
# the same engine, so a mismatch is a bug, refused by name).
MESSAGE_VERSION = 2
KIND = "kind"
VERSION = "version"

_Message = TypeVar("_Message", bound="Message")


@dataclasses.dataclass
class Message:
    """A message's fields are its content; :attr:`KIND` names it."""

    KIND: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        """Plain data for msgpack: the kind, the version and every field."""
        return {KIND: self.KIND, VERSION: MESSAGE_VERSION,
                **{field.name: getattr(self, field.name) for field in dataclasses.fields(self)}}

    @classmethod
    def from_dict(cls: type[_Message], data: dict[str, Any]) -> _Message:
        """The message ``data`` holds; CheckpointWriteError for another kind, another version,
        or a missing or unknown field."""
        names = {field.name for field in dataclasses.fields(cls)}
        keys = set(data) - {KIND, VERSION}
        if data.get(KIND) != cls.KIND or data.get(VERSION) != MESSAGE_VERSION or keys != names:
            raise CheckpointWriteError(
                f"writer process: got a {data.get(KIND)!r} message of version {data.get(VERSION)!r} with fields "
                f"{sorted(keys)}, expected a {cls.KIND!r} message of version {MESSAGE_VERSION} with fields "
                f"{sorted(names)}; the training process and its writer process must run the same engine")
        return cls(**{name: data[name] for name in names})


def kind_of(data: dict[str, Any]) -> Any:
    """The kind a received message says it is."""
    return data.get(KIND)


@dataclasses.dataclass
class WriterConfig(Message):
    """The first message: what the writer process writes, and under which lease."""

    KIND = "config"
    run_dir: str
    # engine.checkpoint.store.lease.WriterLease.handover()
    lease: dict[str, Any]
    arena: str
    # metrics.jsonl's committed length
    metrics_bytes: int
    keep_last: int | None
    keep_best: int
    monitor: str | None
    abandoned: list[str]
    when_behind: str
    # One rank of a torchrun job: how its writer process joins the other ranks' writer processes
    # and takes up their commits (engine.distributed.writer_processes.WriterGroupSpec.to_dict());
    # None in a process alone.
    group: dict[str, Any] | None


@dataclasses.dataclass
class SnapshotMessage(Message):
    """One checkpoint whose tensors are in shared-memory slot ``slot`` (engine.checkpoint.
    writers.process.arena), sent once they are copied there."""

    KIND = "snapshot"
    id: int
    slot: int
    # The slot's file, and the size of tensors.bin in it.
    path: str
    size: int
    header: bytes
    progress: bytes
    # progress.Cursor.to_dict(), or None
    cursor: dict[str, Any] | None
    # metrics.jsonl lines handed over with this snapshot, and where in the file they start.
    metrics: bytes
    metrics_base: int
    # The length metrics.jsonl has once this checkpoint's lines are appended.
    metrics_bytes: int
    # Never replaced by a newer snapshot (a forced one, or one recording a monitored value).
    keep: bool
    # [name, mode, value] of the monitored metric it records, or None
    monitor: list[Any] | None
    # Resumable on another world size (the manifest's ``anchor``).
    anchor: bool
    # A torchrun job's memory tier: whether it also reaches the run dir (always True alone).
    durable: bool
    # A torchrun rank's digest of its replicated state (compared across ranks), or None.
    digest: dict[str, int] | None


@dataclasses.dataclass
class CloseMessage(Message):
    """The last message: commit what is held, then exit."""

    KIND = "close"
