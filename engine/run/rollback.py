"""Rollback past a numerical anomaly (``TrainerConfig(anomaly=engine.Rollback(...))``).

The loops raise :class:`~engine.loops.anomaly.AnomalyDetected` before an optimizer step could
use a bad loss or bad gradients. :class:`Rollbacks` then chooses the checkpoint to go back to
(the newest committed one, or the newest at least ``back`` optimizer steps before the
anomaly) and the batches to skip (``skip_batches`` from the anomalous one on, within its
epoch), and refuses once ``max_rollbacks`` rollbacks are spent. The run
(:meth:`engine.run.run.FitRun._roll_back`) restores the checkpoint in the same process, records
the rollback in its progress, commits at once, and replays: the same numbers as a resume from
that checkpoint, so the replay is exact and a kill at any instant resumes to the same end.

Every rollback is one row of ``anomalies.jsonl`` in the run dir, rewritten whole from the
progress after each rollback and when a run resumes (a kill between the commit and the write
loses no row, and no row is written twice).
"""

from __future__ import annotations

import json
import math
from typing import Any

from engine.checkpoint.policy import RunCheckpointer
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import LoadedCheckpoint
from engine.config import Rollback
from engine.errors import AnomalyError, CheckpointError
from engine.loops.anomaly import AnomalyDetected
from engine.run import state as run_state
from progress import Anomaly

ANOMALIES_FILE = "anomalies.jsonl"
STEPS_RECORD = "flow.optimizer_steps"


class Rollbacks:
    """Plans each rollback of a run with ``Rollback`` (see the module docstring)."""

    def __init__(self, policy: Rollback, checkpoints: RunCheckpointer, storage: Storage, is_writer: bool,
                 batches_per_epoch: int | None) -> None:
        self._policy = policy
        self._checkpoints = checkpoints
        self._storage = storage
        self._is_writer = is_writer
        self._batches_per_epoch = batches_per_epoch

    def plan(self, anomaly: AnomalyDetected, earlier: list[Anomaly], optimizer_steps: int) -> tuple[LoadedCheckpoint, Anomaly]:
        """The checkpoint to restore and the record of this rollback; AnomalyError when the run
        cannot roll back (``max_rollbacks`` spent, no checkpoint old enough)."""
        policy = self._policy
        if len(earlier) >= policy.max_rollbacks:
            raise AnomalyError(f"{anomaly.kind} {anomaly.value} at {anomaly.split} after {len(earlier)} rollback(s): "
                               f"Rollback.max_rollbacks={policy.max_rollbacks} reached; see {ANOMALIES_FILE} for the "
                               "earlier ones, and fix the data or the learning rate, or raise max_rollbacks")
        loaded = self._target(anomaly, optimizer_steps - policy.back)
        first = anomaly.split.batch
        last = first + policy.skip_batches
        if self._batches_per_epoch is not None:
            last = min(last, self._batches_per_epoch)
        record = Anomaly(split=anomaly.split, kind=anomaly.kind, value=anomaly.value, rolled_back_to=loaded.name,
                         rolled_back_cursor=loaded.progress.cursor,
                         skipped=tuple((anomaly.split.epoch, batch) for batch in range(first, last)),
                         optimizer_steps=optimizer_steps)
        return loaded, record

    def _target(self, anomaly: AnomalyDetected, latest_steps: int) -> LoadedCheckpoint:
        """The newest committed checkpoint taken at or before ``latest_steps`` optimizer steps
        (every committed checkpoint precedes the anomalous split, which never completed); chosen
        by rank 0 of a distributed run, loaded by every rank."""
        self._checkpoints.flush()
        loaded = self._checkpoints.select_with(lambda: self._newest_before(latest_steps), run_state.validate)
        if loaded is not None:
            return loaded
        raise AnomalyError(f"{anomaly.kind} {anomaly.value} at {anomaly.split}: no committed checkpoint to roll back "
                           f"to (Rollback.back={self._policy.back} optimizer steps before it); checkpoint more often "
                           "(CheckpointConfig.every_n_splits) or keep more (keep_last)")

    def _newest_before(self, latest_steps: int) -> LoadedCheckpoint | None:
        store = self._checkpoints.store
        for name in reversed(self._checkpoints.existing_names()):
            try:
                loaded = store.load(name, run_state.validate)
            except CheckpointError:
                continue  # torn or corrupt: an older one will do
            if loaded.progress.records[STEPS_RECORD].total.completed <= latest_steps:
                return loaded
        return None

    def publish(self, records: list[Anomaly]) -> None:
        """Rewrite ``anomalies.jsonl`` from the progress's records (writer rank only)."""
        if not self._is_writer or not records:
            return
        lines = [json.dumps(anomaly_row(record)) for record in records]
        self._storage.replace(ANOMALIES_FILE, ("\n".join(lines) + "\n").encode())


class NoRollbacks:
    """A run without ``Rollback``: the loops never raise AnomalyDetected, nothing to publish."""

    def plan(self, anomaly: AnomalyDetected, earlier: list[Anomaly], optimizer_steps: int) -> tuple[LoadedCheckpoint, Anomaly]:
        raise AssertionError("no anomaly is detected without TrainerConfig.anomaly")  # pragma: no cover

    def publish(self, records: list[Anomaly]) -> None:
        pass


def anomaly_row(record: Anomaly) -> dict[str, Any]:
    """One line of ``anomalies.jsonl`` (a non-finite value is written as a string: JSON has none)."""
    value: float | str = record.value if math.isfinite(record.value) else str(record.value)
    cursor = record.rolled_back_cursor
    return {"split": list(record.split.as_tuple()), "kind": record.kind, "value": value,
            "rolled_back_to": record.rolled_back_to, "rolled_back_cursor": None if cursor is None else list(cursor.as_tuple()),
            "skipped_batches": [list(pair) for pair in record.skipped], "step": record.optimizer_steps}
