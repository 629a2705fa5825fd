"""Which checkpoint a run resumes from, across its tiers, and what a resume by name abandons.

:class:`~engine.checkpoint.policy.RunCheckpointer` calls these with the stores its tiering reads
(engine.checkpoint.tiers.tiering); a distributed run's rank 0 chooses for every rank.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Collection

from engine.checkpoint.format.manifest import Manifest
from engine.checkpoint.store.abandoned import ABANDONED_FILE, describe_names, read_abandoned, write_abandoned
from engine.checkpoint.store.catalogue import first_that_loads
from engine.checkpoint.store.checkpoint_store import CheckpointStore, LoadedCheckpoint, StateValidator
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.tiers.fast import latest_across, load_named, stores_newest_first
from engine.errors import CheckpointCorrupt, CheckpointNotFound
from progress import ProgressTree

AUTOMATIC = ("auto", "latest")
"""The ``resume`` values that let the engine choose the checkpoint."""


@dataclasses.dataclass(frozen=True)
class AnchorFallback:
    """A resume on another world size went back from the newest checkpoint ``newest``, taken
    inside a batch, to the newest anchor (see :func:`newest_anchor_before`)."""

    newest: str
    newest_progress: ProgressTree


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


def fall_back_to_anchor(loaded: LoadedCheckpoint, stores: list[CheckpointStore], validate: StateValidator,
                        storage: Storage, needs_an_anchor: Callable[[LoadedCheckpoint], bool]
                        ) -> tuple[LoadedCheckpoint, AnchorFallback | None]:
    """``loaded`` (the "auto"/"latest" choice), or, when ``needs_an_anchor(loaded)`` (a resume on
    another world size that cannot start inside a batch), the newest anchor older than it with
    the fallback made; ``loaded`` again when there is no anchor (its restore then refuses it,
    saying why)."""
    if not needs_an_anchor(loaded):
        return loaded, None
    anchor = newest_anchor_before(loaded.name, stores, validate, read_abandoned(storage))
    if anchor is None:
        return loaded, None
    return anchor, AnchorFallback(loaded.name, loaded.progress)


def newest_anchor_before(name: str, stores: list[CheckpointStore], validate: StateValidator,
                         skip: Collection[str] = ()) -> LoadedCheckpoint | None:
    """The newest checkpoint older than ``name`` (in resume order) whose manifest marks it an
    anchor (resumable on another world size) and that loads and passes ``validate``, leaving
    out ``skip``; one that fails is reported and the next older one tried. Only manifests are
    read to find the candidates."""
    entries = stores_newest_first(stores)
    names = [entry for _, entry in entries]
    manifests = [dict(store.newest_first()) for store in stores]
    anchors = ((store, candidate) for store, candidate in entries[names.index(name) + 1 if name in names else 0:]
               if candidate not in skip and _is_anchor(manifests[stores.index(store)].get(candidate)))
    return first_that_loads(anchors, validate, name_the_store=True, stacklevel=3)


def _is_anchor(manifest: Manifest | None) -> bool:
    return manifest is not None and manifest.anchor


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
    """Record ``newer`` as abandoned (engine.checkpoint.store.abandoned), and ``resumed`` as no longer
    abandoned, before any commit."""
    recorded = read_abandoned(storage)
    abandoned = (recorded - {resumed}) | set(newer)
    if abandoned != recorded:
        write_abandoned(storage, abandoned)
