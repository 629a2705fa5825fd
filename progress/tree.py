"""The progress of every loop of a run, by loop name, with the run's cursor."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from progress._fields import check_keys
from progress.anomalies import Anomaly
from progress.counters import Progress
from progress.cursor import Cursor
from progress.ending import RunEnd
from progress.errors import ProgressSchemaError

# Keys that trees written by earlier versions lack: a missing one reads as None.
OPTIONAL_KEYS = frozenset({"end", "anomalies"})


@dataclasses.dataclass
class ProgressTree:
    """``records`` maps a loop's record name (``"fit.epochs"``, ``"epoch.batches"``, ...) to its
    :class:`Progress`; ``cursor`` is the position of the last completed split, or None before
    the first one; ``end`` says how the run ended when this progress is its end (None while it
    goes on, and in checkpoints of earlier versions, which lack the key); ``anomalies`` are the
    rollbacks past a numerical anomaly so far, with the batches they skipped (empty in
    checkpoints of earlier versions)."""

    records: dict[str, Progress] = dataclasses.field(default_factory=dict)
    cursor: Cursor | None = None
    end: RunEnd | None = None
    anomalies: list[Anomaly] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "records": {name: record.to_dict() for name, record in self.records.items()},
            "cursor": None if self.cursor is None else self.cursor.to_dict(),
            "end": None if self.end is None else self.end.to_dict(),
            "anomalies": [anomaly.to_dict() for anomaly in self.anomalies],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ProgressTree":
        check_keys(cls, data, optional=OPTIONAL_KEYS)
        records = data["records"]
        if not isinstance(records, Mapping) or not all(isinstance(k, str) for k in records):
            raise ProgressSchemaError("ProgressTree.records: expected a mapping of names to records")
        cursor, end = data["cursor"], data.get("end")
        return cls(
            records={name: _record(name, value) for name, value in records.items()},
            cursor=None if cursor is None else Cursor.from_dict(cursor),
            end=None if end is None else RunEnd.from_dict(end),
            anomalies=_anomalies(data.get("anomalies", [])),
        )


def _record(name: str, data: Any) -> Progress:
    try:
        return Progress.from_dict(data)
    except ProgressSchemaError as error:
        raise ProgressSchemaError(f"record {name!r}: {error}") from error


def _anomalies(data: Any) -> list[Anomaly]:
    if not isinstance(data, list):
        raise ProgressSchemaError(f"ProgressTree.anomalies: expected a list, got {type(data).__name__}")
    return [Anomaly.from_dict(item) for item in data]
