"""Which checkpoints to keep after a commit: the newest ``keep_last`` that verify, plus the
``keep_best`` best by the monitored metric (never deleted, and not counted in ``keep_last``).
Checkpoints a resume from an older one ``abandoned`` (engine.checkpoint.abandoned) are deleted
at the first commit after it, and not counted either."""

from __future__ import annotations

import dataclasses

from engine.checkpoint.store import CheckpointStore


@dataclasses.dataclass(frozen=True)
class Retention:
    keep_last: int | None
    keep_best: int = 0
    monitor: str | None = None
    abandoned: frozenset[str] = frozenset()

    def apply(self, store: CheckpointStore, generation: int | None) -> None:
        """Delete what falls outside the policy (only after a newer checkpoint committed)."""
        if self.keep_last is None:
            return
        protected = store.best(self.keep_best, self.monitor) if self.keep_best and self.monitor else []
        store.apply_retention(self.keep_last, generation, [name for name in protected if name not in self.abandoned],
                              self.abandoned)
