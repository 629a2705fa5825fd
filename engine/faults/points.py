"""Fault injection: named points in the loops and in the checkpoint commit protocol where a
test can make the process fail on purpose.

Configure by API (:func:`inject`) or, for a subprocess, by the environment variable
``SPLITLOOP_FAULTS``: a comma-separated list of ``POINT:HIT:KIND`` where HIT is the 1-based
count of arrivals at POINT that triggers the fault, and KIND one of ``raise``, ``sigkill``,
``sigterm``, ``enospc``, ``eio``, ``hang`` (the process sleeps there forever, in Python: a rank
stuck in user code, or a storage write that never returns at ``filesystem_write``) or ``sigstop``
(the process stops itself: a rank the kernel stopped). The last two are what the watchdog
(docs/faults.md, "Hangs") detects. Example::

    SPLITLOOP_FAULTS=split_end:7:sigkill python train.py

``python -m engine faults`` lists the points.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import time
from typing import Iterable

from engine.errors import ConfigError, InjectedFault

ENVIRONMENT_VARIABLE = "SPLITLOOP_FAULTS"

# The points, by where they are (each group in the order a run reaches them).
LOOP_POINTS: dict[str, str] = {
    "step_start": "before the user's training step is called",
    "after_backward": "after backward, before the optimizer step (automatic optimization)",
    "after_optimizer_step": "after an optimizer step",
    "split_end": "after a split completed, before its checkpoint",
    "split_end_after_checkpoint": "after a split's boundary work, checkpoint included",
    "batch_end": "after a batch completed",
    "epoch_end": "after an epoch completed, before its checkpoint",
}
VALIDATION_POINTS: dict[str, str] = {
    "validation_batch_end": "after each batch of a validation pass",
}
ROLLBACK_POINTS: dict[str, str] = {
    "after_rollback": "after a rollback restored a checkpoint, before the commit that records it (Rollback)",
}
CHECKPOINT_POINTS: dict[str, str] = {
    "checkpoint_before_file": "inside a checkpoint write, before each data file",
    "checkpoint_after_file": "inside a checkpoint write, after each data file",
    "checkpoint_before_manifest": "inside a checkpoint write, after the data files, before the manifest",
    "checkpoint_before_rename": "after the manifest, before the atomic rename (local filesystems)",
    "checkpoint_after_rename": "after the rename, before the directory fsync and retention",
    "checkpoint_retention": "while deleting checkpoints beyond keep_last",
}
MEMORY_TIER_POINTS: dict[str, str] = {
    "memory_tier_peer_copy": "under torchrun with a memory tier: a rank's part is in node memory, its peer copy not sent",
    "memory_tier_refill": "at a restart from the memory tier: a part received from a peer, before this node keeps it",
}
IO_POINTS: dict[str, str] = {
    "filesystem_write": "each write-type call on the run directory's filesystem (needs enospc/eio to mean an I/O error)",
}
POINTS: dict[str, str] = {**LOOP_POINTS, **VALIDATION_POINTS, **ROLLBACK_POINTS, **CHECKPOINT_POINTS, **MEMORY_TIER_POINTS,
                         **IO_POINTS}

KINDS = ("raise", "sigkill", "sigterm", "enospc", "eio", "hang", "sigstop")
HANG_KINDS = ("hang", "sigstop")


@dataclasses.dataclass(frozen=True)
class Fault:
    """Trigger ``kind`` the ``hit``-th time ``point`` is reached."""

    point: str
    hit: int
    kind: str

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ConfigError(f"fault point {self.point!r} does not exist; see `python -m engine faults`")
        if isinstance(self.hit, bool) or not isinstance(self.hit, int) or self.hit <= 0:
            raise ConfigError(f"fault hit: expected a positive int, got {self.hit!r}")
        if self.kind not in KINDS:
            raise ConfigError(f"fault kind {self.kind!r}: expected one of {list(KINDS)}")

    def encode(self) -> str:
        return f"{self.point}:{self.hit}:{self.kind}"


def parse_faults(text: str) -> list[Fault]:
    """Parse the ``SPLITLOOP_FAULTS`` syntax."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        pieces = item.split(":")
        if len(pieces) != 3 or not (pieces[1].isascii() and pieces[1].isdigit()):
            raise ConfigError(f"{ENVIRONMENT_VARIABLE}: {item!r} is not POINT:HIT:KIND")
        faults.append(Fault(pieces[0], int(pieces[1]), pieces[2]))
    return faults


class _Registry:
    def __init__(self) -> None:
        self.faults: dict[str, list[Fault]] = {}
        self.arrivals: dict[str, int] = {}
        self.fired: list[Fault] = []

    def set(self, faults: Iterable[Fault]) -> None:
        self.faults = {}
        self.arrivals = {}
        self.fired = []
        for fault in faults:
            self.faults.setdefault(fault.point, []).append(fault)


_registry = _Registry()
# Checked on every arrival: a plain module global keeps the no-fault case one comparison.
_active = False


def inject(faults: Iterable[Fault]) -> None:
    """Arm ``faults`` in this process (replacing any armed before); arrival counts restart."""
    global _active
    _registry.set(list(faults))
    _active = bool(_registry.faults)


def clear() -> None:
    """Disarm every fault."""
    inject([])


def arm_from_environment() -> None:
    """Arm what ``SPLITLOOP_FAULTS`` names (called when a fit starts)."""
    text = os.environ.get(ENVIRONMENT_VARIABLE, "")
    if text:
        inject(parse_faults(text))


def armed_at(point: str) -> bool:
    """Whether any fault is armed at ``point``."""
    return _active and point in _registry.faults


def fired() -> list[Fault]:
    """The armed faults that have triggered in this process (an I/O fault counts when its
    error was handed out, whether or not the caller then tolerated it)."""
    return list(_registry.fired)


def arrivals(point: str) -> int:
    """How many times ``point`` was reached since faults were last armed (counted only while
    some fault is armed)."""
    return _registry.arrivals.get(point, 0)


def reach(point: str) -> None:
    """Mark an arrival at ``point``; trigger a fault armed for this arrival."""
    if not _active:
        return
    count = _registry.arrivals.get(point, 0) + 1
    _registry.arrivals[point] = count
    for fault in _registry.faults.get(point, ()):
        if fault.hit == count:
            _trigger(fault)


def io_error_due(point: str) -> OSError | None:
    """Like :func:`reach`, but an I/O fault is returned for the caller's filesystem call to raise."""
    if not _active:
        return None
    count = _registry.arrivals.get(point, 0) + 1
    _registry.arrivals[point] = count
    for fault in _registry.faults.get(point, ()):
        if fault.hit == count:
            if fault.kind in ("enospc", "eio"):
                _registry.fired.append(fault)
                return _os_error(fault.kind, point)
            _trigger(fault)
    return None


def _os_error(kind: str, point: str) -> OSError:
    code = errno.ENOSPC if kind == "enospc" else errno.EIO
    return OSError(code, f"{os.strerror(code)} (injected at {point})")


def _trigger(fault: Fault) -> None:
    _registry.fired.append(fault)
    if fault.kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif fault.kind in ("enospc", "eio"):
        raise _os_error(fault.kind, fault.point)
    elif fault.kind == "hang":
        _hang_forever()
    elif fault.kind == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise InjectedFault(f"injected fault at {fault.point} (arrival {fault.hit})")


def _hang_forever() -> None:
    """Never return (a ``hang`` fault): sleep, as user code stuck in a wait does."""
    while True:
        time.sleep(3600)
