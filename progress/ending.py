"""How a run ended: the stop that finished it and the limits it ran under.

A checkpoint taken when the run finished (``max_epochs``/``max_steps``/``max_time`` reached, or
a stop requested by a callback such as early stopping) carries a :class:`RunEnd`; a preemption
is not an end (the run resumes). Resuming a checkpoint with an end trains nothing more unless a
limit was raised (:meth:`RunEnd.raised_limits`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from progress._fields import check_keys, fields_to_dict, require_int
from progress.errors import ProgressSchemaError

LIMIT_NAMES = ("max_epochs", "max_steps", "max_time")


@dataclasses.dataclass(frozen=True)
class RunEnd:
    """``reason`` says why the run stopped; the limits are those it was trained under (None:
    no limit)."""

    reason: str
    max_epochs: int | None = None
    max_steps: int | None = None
    max_time: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return fields_to_dict(self, lambda value: value)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunEnd":
        check_keys(cls, data)
        reason = data["reason"]
        if not isinstance(reason, str) or not reason:
            raise ProgressSchemaError(f"RunEnd.reason: expected a non-empty string, got {reason!r}")
        max_time = data["max_time"]
        if max_time is not None and (isinstance(max_time, bool) or not isinstance(max_time, (int, float))
                                     or not math.isfinite(max_time) or max_time < 0):
            raise ProgressSchemaError(f"RunEnd.max_time: expected None or a finite number >= 0, got {max_time!r}")
        return cls(reason=reason, max_epochs=_optional_int("max_epochs", data["max_epochs"]),
                   max_steps=_optional_int("max_steps", data["max_steps"]),
                   max_time=None if max_time is None else float(max_time))

    def raised_limits(self, max_epochs: int | None, max_steps: int | None, max_time: float | None) -> list[str]:
        """The limits that are higher now than when the run ended (None is no limit, the
        highest), each as ``"max_steps 20 -> 30"``; empty when none was raised."""
        now = {"max_epochs": max_epochs, "max_steps": max_steps, "max_time": max_time}
        return [f"{name} {getattr(self, name)} -> {'no limit' if now[name] is None else now[name]}"
                for name in LIMIT_NAMES if _higher(now[name], getattr(self, name))]


def _higher(now: float | None, then: float | None) -> bool:
    if then is None:
        return False
    return now is None or now > then


def _optional_int(name: str, value: Any) -> int | None:
    return None if value is None else require_int("RunEnd", name, value)
