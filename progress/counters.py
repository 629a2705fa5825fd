"""Progress counters: how many units of work were made ready, started, processed, completed.

Counters advance in that fixed order. After a crash, ``started - completed`` is what was in
flight; :meth:`Progress.reset_on_restart` rolls in-flight counts back to ``completed`` so the
interrupted unit is counted once when it runs again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from progress._fields import check_keys, fields_to_dict, require_int
from progress.errors import ProgressSchemaError


@dataclasses.dataclass
class Counts:
    """Four monotone counters for one scope (the whole run, or since the last reset)."""

    ready: int = 0
    started: int = 0
    processed: int = 0
    completed: int = 0

    def to_dict(self) -> dict[str, int]:
        return fields_to_dict(self, lambda value: value)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Counts":
        check_keys(cls, data)
        counts = cls(**{name: require_int(cls.__name__, name, value) for name, value in data.items()})
        # Counters advance in order, so each is at most the one before it; anything else is not
        # a record this package wrote (a hand-edited or hostile file).
        if not counts.ready >= counts.started >= counts.processed >= counts.completed:
            raise ProgressSchemaError(f"{cls.__name__}: {counts.to_dict()} is out of order "
                                      "(expected ready >= started >= processed >= completed)")
        return counts

    def reset(self) -> None:
        self.ready = self.started = self.processed = self.completed = 0

    def roll_back_in_flight(self) -> None:
        """Forget work that was made ready or started but never completed."""
        self.ready = self.started = self.processed = self.completed


@dataclasses.dataclass
class Progress:
    """Counts kept twice: ``total`` for the whole run, ``current`` since the enclosing loop last
    reset this record (for example the batches of the current epoch)."""

    total: Counts = dataclasses.field(default_factory=Counts)
    current: Counts = dataclasses.field(default_factory=Counts)

    def to_dict(self) -> dict[str, dict[str, int]]:
        return fields_to_dict(self, lambda counts: counts.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Progress":
        check_keys(cls, data)
        progress = cls(**{name: Counts.from_dict(value) for name, value in data.items()})
        # ``current`` counts since the last reset, a part of ``total``.
        for name, current in progress.current.to_dict().items():
            if current > getattr(progress.total, name):
                raise ProgressSchemaError(f"{cls.__name__}: current.{name} {current} exceeds total.{name} "
                                          f"{getattr(progress.total, name)}")
        return progress

    def increment_ready(self) -> None:
        self.total.ready += 1
        self.current.ready += 1

    def increment_started(self) -> None:
        self.total.started += 1
        self.current.started += 1

    def increment_processed(self) -> None:
        self.total.processed += 1
        self.current.processed += 1

    def increment_completed(self) -> None:
        self.total.completed += 1
        self.current.completed += 1

    def reset_current(self) -> None:
        self.current.reset()

    def reset_on_restart(self) -> None:
        """Roll back what a crash left in flight, in both scopes."""
        self.total.roll_back_in_flight()
        self.current.roll_back_in_flight()

    @property
    def in_flight(self) -> int:
        """Units started but not completed in the current scope."""
        return self.current.started - self.current.completed
