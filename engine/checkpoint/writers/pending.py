"""One checkpoint on its way to a writer: the encoded state, its progress, and what its commit
records (torch-free: the writer process builds them too)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from engine.checkpoint.format.encoded_state import EncodedState
from engine.checkpoint.format.manifest import MonitorRecord
from progress import Cursor

if TYPE_CHECKING:
    from engine.checkpoint.writers.buffers import SnapshotBuffers


@dataclasses.dataclass
class PendingCheckpoint:
    encoded: EncodedState
    progress_bytes: bytes
    cursor: Cursor | None
    buffers: SnapshotBuffers | None = None
    # The length metrics.jsonl has once the lines this checkpoint counts are appended (after
    # the fence, by the writer's metrics log); 0: none to publish.
    metrics_bytes: int = 0
    # With a fast tier: whether this checkpoint must also reach the durable tier.
    durable: bool = True
    # The monitored metric's fresh value this checkpoint is taken for (best checkpoints).
    monitor: MonitorRecord | None = None
    # Resumable on another world size (the manifest's ``anchor``).
    anchor: bool = False
    # A distributed run's digest of its replicated state (compared across ranks at commit).
    digest: dict[str, int] | None = None
    # The splits the run had completed when it was handed to the writer (what a report of a hung
    # writer names it by; None without a watchdog).
    split: int | None = None
