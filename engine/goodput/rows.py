"""The ledger's files and rows: one JSON object per line, appended, never rewritten.

Each rank appends to its own file, ``ledger/rank-NNNNN.jsonl`` (one writer per file: on an
object store an append rewrites the object, and two writers would lose each other's rows). A
line cut short by a kill is skipped on read, and the next attempt starts on a fresh line, so a
torn row never glues onto the next one. Every row names its attempt and its place in it
(``seq``): a row is never counted twice.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

LEDGER_DIRECTORY = "ledger"
SCHEMA_VERSION = 1
_RANK_FILE = re.compile(r"rank-(\d{5})\.jsonl")

# Events, in the order an attempt writes them.
START, RESTORED, TRAINING, COMMIT, VALIDATION, BEAT, END = (
    "start", "restored", "training", "commit", "validation", "beat", "end")
# Exit causes: the first three are written by the attempt, the last two inferred when reading.
FINISHED, PREEMPTED, EXCEPTION, INTERRUPTED, HANG, KILLED = (
    "finished", "preempted", "exception", "interrupted", "hang", "killed")


class LedgerStorage(Protocol):
    """The part of the run's storage the ledger uses (engine.checkpoint.store.storage.Storage;
    its ``is_local`` is read where present)."""

    def append(self, relative: str, data: bytes) -> None: ...

    def exists(self, relative: str) -> bool: ...

    def read(self, relative: str, limit: int | None = None) -> bytes: ...

    def makedirs(self, relative: str) -> None: ...

    def list_names(self, relative: str) -> list[str]: ...


def rank_file(rank: int) -> str:
    return f"{LEDGER_DIRECTORY}/rank-{rank:05d}.jsonl"


def ranks_with_files(storage: LedgerStorage) -> list[int]:
    """The ranks that wrote a ledger file, in order."""
    found = (_RANK_FILE.fullmatch(name) for name in storage.list_names(LEDGER_DIRECTORY))
    return sorted(int(match.group(1)) for match in found if match)


def encode(row: dict[str, Any]) -> bytes:
    return (json.dumps(row, sort_keys=True, separators=(",", ":")) + "\n").encode()


def parse(data: bytes) -> list[dict[str, Any]]:
    """The rows of a ledger file: lines that do not parse as a JSON object of this schema (a
    torn last line) are skipped; a row seen again (same attempt and seq) is kept once."""
    rows, seen = [], set()
    for line in data.decode("utf-8", "replace").split("\n"):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or row.get("v") != SCHEMA_VERSION:
            continue
        key = (row.get("attempt"), row.get("seq"))
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows


def read_rank(storage: LedgerStorage, rank: int) -> list[dict[str, Any]]:
    relative = rank_file(rank)
    return parse(storage.read(relative)) if storage.exists(relative) else []
