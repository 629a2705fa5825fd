"""Which checkpoints to keep after a commit: the newest ``keep_last`` that verify, plus the
``keep_best`` best by the monitored metric (never deleted, and not counted in ``keep_last``).
Checkpoints a resume from an older one ``abandoned`` (engine.checkpoint.store.abandoned) are deleted
at the first commit after it, and not counted either. The newest *anchor* that verifies (a
checkpoint a resume on another world size can start from: its manifest's ``anchor``, written
by runs whose data order is global) is kept too when it is older than the last ``keep_last``,
beyond them: so a run that checkpoints inside batches (TBPTT, accumulation
windows) can always change its world size."""

from __future__ import annotations

import dataclasses
from typing import Callable, Collection, Protocol

from engine.checkpoint.format.manifest import Manifest
from engine.checkpoint.format.names import sequence_of


class RetainingStore(Protocol):
    """What retention needs of a store (engine.checkpoint.store.checkpoint_store.CheckpointStore)."""

    def best(self, count: int, monitor: str | None = None) -> list[str]:
        """The best ``count`` checkpoints by ``monitor``, best first."""
        ...

    def apply_retention(self, keep_last: int | None, generation: int | None = None,
                        protected: Collection[str] = (), abandoned: Collection[str] = ()) -> None:
        """Delete what falls outside ``keep_last`` (see CheckpointStore.apply_retention)."""
        ...


@dataclasses.dataclass(frozen=True)
class Retention:
    keep_last: int | None
    keep_best: int = 0
    monitor: str | None = None
    abandoned: frozenset[str] = frozenset()

    def apply(self, store: RetainingStore, generation: int | None) -> None:
        """Delete what falls outside the policy (only after a newer checkpoint committed)."""
        if self.keep_last is None:
            return
        protected = store.best(self.keep_best, self.monitor) if self.keep_best and self.monitor else []
        store.apply_retention(self.keep_last, generation, [name for name in protected if name not in self.abandoned],
                              self.abandoned)


def retired_by_policy(entries: list[tuple[str, Manifest | None]], keep_last: int, generation: int | None,
                      protected: Collection[str], abandoned: Collection[str],
                      verifies: Callable[[str], bool]) -> list[str]:
    """The checkpoints :meth:`CheckpointStore.apply_retention` deletes, of ``entries`` (names with
    their manifests, newest first): see there."""
    kept: list[str] = []
    doomed: list[str] = []
    anchor = newest_anchor(entries, abandoned, verifies)
    for name, manifest in entries:
        if manifest is not None and name in abandoned and (generation is None or manifest.writer_generation < generation):
            doomed.append(name)
            continue
        if manifest is None or name in protected:
            continue
        if len(kept) < keep_last:
            if verifies(name):
                kept.append(name)
        elif name != anchor and (generation is None or manifest.writer_generation <= generation):
            doomed.append(name)
    if len(kept) < keep_last:
        return []
    oldest_kept = min(sequence_of(name) for name in kept)
    unreadable = [name for name, manifest in entries if manifest is None and sequence_of(name) < oldest_kept]
    return doomed + unreadable


def newest_anchor(entries: list[tuple[str, Manifest | None]], abandoned: Collection[str],
                  verifies: Callable[[str], bool]) -> str | None:
    """The newest of ``entries`` (newest first) whose manifest marks it an anchor and that
    verifies, leaving out ``abandoned`` ones; None when there is none."""
    for name, manifest in entries:
        if manifest is not None and manifest.anchor and name not in abandoned and verifies(name):
            return name
    return None
