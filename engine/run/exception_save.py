"""Save on exception: when an exception (or Ctrl-C) ends ``fit``, commit a checkpoint of the
last completed boundary if it is newer than the newest checkpoint and can still be
reconstructed exactly, then let the exception go on.

At each boundary that no checkpoint holds, :class:`ExceptionSave` keeps a cheap record of it:
the state entries that change without an optimizer step (engine.run.state.capture_volatile:
loop states with the hidden state and pending gradients, random streams, schedulers,
callbacks; containers copied, tensors by reference), the encoded progress, and the version
counter of every tensor it references and of the model's parameters and buffers. The model
and optimizers are not copied: when the exception comes, the record is exact only if nothing
has changed them since (no optimizer step started, no scheduler stepped, no hyper-parameter
changed, no referenced tensor written in place: ``Tensor._version``); it is then completed
with the live model and optimizers and committed like any checkpoint. Otherwise nothing is
written, and a note under the traceback says why.

A distributed run never saves on an exception: the other ranks are not at the same boundary
to commit with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch

from engine.checkpoint.checkpointing import BoundaryMark, CheckpointSink
from engine.checkpoint.store.metrics_log import MetricsLog
from engine.errors import CheckpointError, warn as warn_user
from engine.run import state as run_state
from progress import Cursor, ProgressTree, decode_tree, encode_tree


@dataclasses.dataclass
class BoundaryRecord:
    """One boundary as a checkpoint would hold it, less the model and optimizers, with what
    tells whether those are still as they were there."""

    volatile: dict[str, Any]
    progress_bytes: bytes
    cursor: Cursor | None
    optimizer_steps: int
    mark: BoundaryMark
    steps_started: int
    scheduler_epochs: list[object]
    hyperparameters: list[list[dict[str, Any]]]
    versions: list[tuple[torch.Tensor, int]] | None  # None: a tensor without a version counter

    def changed_since(self, parts: run_state.RunParts) -> str | None:
        """What changed since this boundary that the record cannot give back (None: nothing)."""
        if parts.tree.step_counter.progress.total.started != self.steps_started:
            return "an optimizer step started"
        if _scheduler_epochs(parts) != self.scheduler_epochs:
            return "an LR scheduler stepped"
        if not _same(_hyperparameters(parts), self.hyperparameters):
            return "an optimizer hyper-parameter changed"
        if self.versions is None:
            return "a tensor of the state has no version counter (an inference tensor)"
        if any(tensor._version != version for tensor, version in self.versions):
            return "a parameter, buffer, gradient or hidden state was written in place"
        return None

    def snapshot(self, parts: run_state.RunParts) -> run_state.RunSnapshot:
        """The checkpoint of this boundary, with the (unchanged) live model and optimizers."""
        return run_state.complete(parts, self.volatile, decode_tree(self.progress_bytes))


class ExceptionSave:
    """Keeps the record of the last boundary no checkpoint holds, and commits it when an
    exception ends the run (see the module docstring)."""

    def __init__(self, parts: run_state.RunParts, checkpoints: CheckpointSink) -> None:
        self._parts = parts
        self._checkpoints = checkpoints
        self._record: BoundaryRecord | None = None

    def remember(self, progress: ProgressTree, cursor: Cursor | None, optimizer_steps: int, mark: BoundaryMark,
                 metrics: MetricsLog, elapsed_seconds: float) -> None:
        """Called at the end of each boundary, after any checkpoint of it; seals the metrics
        lines so far (the record's checkpoint commits them)."""
        if self._checkpoints.holds(mark):
            self._record = None
            return
        parts = self._parts
        volatile = _copy_containers(run_state.capture_volatile(parts, metrics.snapshot(), elapsed_seconds))
        # Assigned whole: a Ctrl-C while the record is built leaves the previous one, still exact.
        self._record = BoundaryRecord(
            volatile, encode_tree(progress), cursor, optimizer_steps, mark,
            steps_started=parts.tree.step_counter.progress.total.started,
            scheduler_epochs=_scheduler_epochs(parts), hyperparameters=_hyperparameters(parts),
            versions=_versions(_tensors(volatile), parts.module))

    def forget(self) -> None:
        """A checkpoint is being saved: the record is no longer newer than the newest checkpoint."""
        self._record = None

    def save_before_raising(self, error: BaseException) -> None:
        """Commit the record if it is still exact, and say under ``error``'s traceback what
        was done. Never raises an error of its own over ``error`` (a failure is a note)."""
        record, self._record = self._record, None
        if record is None:
            return
        if isinstance(error, CheckpointError):
            _note(error, f"no checkpoint saved for {_where(record)}: the exception came from checkpointing itself")
            return
        changed = record.changed_since(self._parts)
        if changed is not None:
            _note(error, f"no checkpoint saved for {_where(record)}: it cannot be reconstructed exactly, {changed} "
                         "since; resume starts from the newest committed checkpoint")
            return
        try:
            written = self._checkpoints.save(record.snapshot(self._parts), record.cursor, record.optimizer_steps,
                                             record.mark, force=True)
            if written:  # an asynchronous writer commits it now: the note names it, not an older one
                self._checkpoints.flush()
        except Exception as failure:
            _note(error, f"saving {_where(record)} before raising failed: {type(failure).__name__}: {failure}")
            return
        if written:
            _note(error, f"saved {self._checkpoints.last_name} at {_where(record)} before raising; "
                         "fit resumes there")


class NoExceptionSave:
    """A run without checkpoints has nothing to save; a distributed one cannot save alone
    (``reason``: why, noted under the exception)."""

    def __init__(self, reason: str | None = None) -> None:
        self._reason = reason

    def remember(self, progress: ProgressTree, cursor: Cursor | None, optimizer_steps: int, mark: BoundaryMark,
                 metrics: MetricsLog, elapsed_seconds: float) -> None:
        pass

    def forget(self) -> None:
        pass

    def save_before_raising(self, error: BaseException) -> None:
        if self._reason is not None:
            _note(error, f"no checkpoint saved on this exception: {self._reason}")


def _where(record: BoundaryRecord) -> str:
    cursor = record.cursor
    if cursor is None:
        return "the last boundary"
    return f"epoch {cursor.epoch} batch {cursor.batch} split {cursor.split} (the last completed split)"


def _note(error: BaseException, text: str) -> None:
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(f"splitloop: {text}")
    else:  # pragma: no cover - Python 3.10
        warn_user(f"splitloop: {text}")


def _scheduler_epochs(parts: run_state.RunParts) -> list[object]:
    return [getattr(schedule.scheduler, "last_epoch", None) for schedule in parts.setup.schedules]


def _hyperparameters(parts: run_state.RunParts) -> list[list[dict[str, Any]]]:
    return [[{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
            for optimizer in parts.setup.optimizers]


def _same(first: Any, second: Any) -> bool:
    """Equality that compares tensors by value (``==`` on them is elementwise)."""
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)
                and first.shape == second.shape and bool(torch.equal(first, second)))
    if isinstance(first, dict) and isinstance(second, dict):
        return first.keys() == second.keys() and all(_same(first[key], second[key]) for key in first)
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)):
        return len(first) == len(second) and all(_same(a, b) for a, b in zip(first, second))
    return bool(first == second)


def _copy_containers(value: Any) -> Any:
    """Copy dicts, lists and tuples (the live objects may change them later); keep tensors and
    immutable leaves. Tensors are guarded by their version counters instead."""
    if isinstance(value, dict):
        return {key: _copy_containers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy_containers(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_copy_containers(item) for item in value)
    return value


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _versions(volatile_tensors: Iterator[torch.Tensor], module: torch.nn.Module) -> list[tuple[torch.Tensor, int]] | None:
    tensors = [*volatile_tensors, *module.parameters(), *module.buffers()]
    try:
        return [(tensor, tensor._version) for tensor in tensors]
    except RuntimeError:  # an inference tensor has no version counter
        return None
