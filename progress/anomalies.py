"""One rollback past a numerical anomaly, as the run's progress records it.

A run with ``TrainerConfig(anomaly=engine.Rollback(...))`` that meets a non-finite or spiking
loss (or non-finite gradients) restores an earlier checkpoint and skips the batches that caused
it. Each rollback is one :class:`Anomaly` in the progress tree, so the skipped batches are part
of every later checkpoint: a killed run that resumes skips them again.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from progress._fields import check_keys, require_int
from progress.cursor import Cursor
from progress.errors import ProgressSchemaError

KINDS = ("non-finite loss", "non-finite gradients", "loss spike")


@dataclasses.dataclass(frozen=True)
class Anomaly:
    """``split``: the split whose step met the anomaly (never completed); ``kind``: one of
    :data:`KINDS`; ``value``: the loss (or, for gradients, their norm); ``rolled_back_to``: the
    checkpoint restored and its cursor (None: before the first split); ``skipped``: the
    ``[epoch, batch]`` pairs never trained since; ``optimizer_steps``: the steps applied before
    the anomaly (where ``plot`` marks it)."""

    split: Cursor
    kind: str
    value: float
    rolled_back_to: str
    rolled_back_cursor: Cursor | None
    skipped: tuple[tuple[int, int], ...]
    optimizer_steps: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "split": self.split.to_dict(),
            "kind": self.kind,
            # As text when not finite ("nan", "inf"): NaN equals nothing, and a progress tree
            # must equal itself after a round trip.
            "value": self.value if math.isfinite(self.value) else str(self.value),
            "rolled_back_to": self.rolled_back_to,
            "rolled_back_cursor": None if self.rolled_back_cursor is None else self.rolled_back_cursor.to_dict(),
            "skipped": [list(pair) for pair in self.skipped],
            "optimizer_steps": self.optimizer_steps,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Anomaly":
        check_keys(cls, data)
        kind, value, name = data["kind"], data["value"], data["rolled_back_to"]
        if kind not in KINDS:
            raise ProgressSchemaError(f"Anomaly.kind: expected one of {list(KINDS)}, got {kind!r}")
        if isinstance(value, str) and value in ("nan", "inf", "-inf"):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProgressSchemaError(f"Anomaly.value: expected a number (or 'nan', 'inf', '-inf'), got {value!r}")
        if not isinstance(name, str):
            raise ProgressSchemaError(f"Anomaly.rolled_back_to: expected a checkpoint name, got {name!r}")
        cursor = data["rolled_back_cursor"]
        return cls(split=Cursor.from_dict(data["split"]), kind=kind, value=float(value), rolled_back_to=name,
                   rolled_back_cursor=None if cursor is None else Cursor.from_dict(cursor),
                   skipped=_pairs(data["skipped"]),
                   optimizer_steps=require_int("Anomaly", "optimizer_steps", data["optimizer_steps"]))

    def describe(self) -> str:
        """One line: which split, what value, where the run went back to, what it skipped."""
        where = "the start" if self.rolled_back_cursor is None else str(self.rolled_back_cursor)
        value = f"{self.value:.6g}" if math.isfinite(self.value) else str(self.value)
        skipped = ", ".join(f"epoch {epoch} batch {batch}" for epoch, batch in self.skipped)
        return f"{self.kind} {value} at {self.split}: rolled back to {self.rolled_back_to} ({where}), skipped {skipped}"


def _pairs(data: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(data, (list, tuple)) or not all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in data):
        raise ProgressSchemaError(f"Anomaly.skipped: expected [epoch, batch] pairs, got {data!r}")
    return tuple((require_int("Anomaly", "skipped", epoch), require_int("Anomaly", "skipped", batch))
                 for epoch, batch in data)
