"""Which checkpoint a run resumes from, across its tiers, and what a resume by name abandons.

:class:`~engine.checkpoint.policy.RunCheckpointer` calls these with the stores its tiering reads
(engine.checkpoint.tiering); a distributed run's rank 0 chooses for every rank.
"""

from __future__ import annotations

import warnings

from engine.checkpoint.abandoned import ABANDONED_FILE, describe_names, read_abandoned, write_abandoned
from engine.checkpoint.storage import Storage
from engine.checkpoint.store import CheckpointStore, LoadedCheckpoint, StateValidator
from engine.checkpoint.tiers import latest_across, load_named, stores_newest_first
from engine.errors import CheckpointCorrupt, CheckpointNotFound


def choose_checkpoint(resume: str, validate: StateValidator, stores: list[CheckpointStore],
                      storage: Storage) -> LoadedCheckpoint | None:
    """The checkpoint ``resume`` names (as in ``Trainer.fit``) in ``stores``, or None to start
    fresh. "auto"/"latest" take the newest that verifies and whose state passes ``validate``,
    leaving out abandoned ones; a run dir whose every checkpoint is invalid is refused, never
    restarted silently."""
    if resume == "off":
        return None
    if resume not in ("auto", "latest"):
        return load_named(stores, resume, validate)
    latest = latest_across(stores, validate, _skipped_as_abandoned(stores, storage))
    if latest is not None:
        return latest
    existing = [name for store in stores for name in store.committed_names()]
    if existing:
        raise CheckpointCorrupt(
            f"{len(existing)} checkpoint(s) in {storage.url} and none verifies; "
            "refusing to start over silently (pass resume='off' to start a fresh run)"
        )
    if resume == "latest":
        raise CheckpointNotFound(f"resume='latest' but {storage.url} holds no checkpoint")
    return None


def _skipped_as_abandoned(stores: list[CheckpointStore], storage: Storage) -> frozenset[str]:
    """The abandoned checkpoints "auto"/"latest" leaves out, with a warning naming those
    still present."""
    abandoned = read_abandoned(storage)
    present = sorted({name for store in stores for name in store.committed_names()} & abandoned)
    if present:
        warnings.warn(f"resume: skipping {describe_names(present)}: a run resumed from an older checkpoint "
                      f"abandoned them ({storage.url}/{ABANDONED_FILE}); resume one by name to return "
                      "to it", stacklevel=5)
    return abandoned


def newer_than(name: str, stores: list[CheckpointStore]) -> list[str]:
    """The checkpoints of ``stores`` newer than ``name`` in resume order, oldest first."""
    names = [entry for _, entry in stores_newest_first(stores)]
    return sorted(set(names[:names.index(name)])) if name in names else []


def record_abandoned(storage: Storage, resumed: str, newer: list[str]) -> None:
    """Record ``newer`` as abandoned (engine.checkpoint.abandoned), and ``resumed`` as no longer
    abandoned, before any commit."""
    recorded = read_abandoned(storage)
    abandoned = (recorded - {resumed}) | set(newer)
    if abandoned != recorded:
        write_abandoned(storage, abandoned)
