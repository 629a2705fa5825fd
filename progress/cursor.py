"""The cursor: the exact position of a run."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from progress._fields import check_keys, fields_to_dict, require_int


@dataclasses.dataclass(frozen=True)
class Cursor:
    """``(epoch, batch, split, optimizer)``, all zero-based.

    In a checkpoint the cursor names the last completed split: epoch ``epoch``, batch ``batch``
    of that epoch, split ``split`` of that batch; ``optimizer`` is the index of the last
    optimizer that ran in that split (with several optimizers each split runs all of them,
    so at a split boundary it is their count minus one; 0 with one optimizer).
    """

    epoch: int = 0
    batch: int = 0
    split: int = 0
    optimizer: int = 0

    def to_dict(self) -> dict[str, int]:
        return fields_to_dict(self, lambda value: value)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Cursor":
        check_keys(cls, data)
        return cls(**{name: require_int(cls.__name__, name, value) for name, value in data.items()})

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.epoch, self.batch, self.split, self.optimizer)

    def __str__(self) -> str:
        return f"epoch {self.epoch}, batch {self.batch}, split {self.split}, optimizer {self.optimizer}"
