"""Checkpoints abandoned by a resume from an older checkpoint.

Resuming by name from a checkpoint that is not the newest starts a new branch of the run's
history; the newer checkpoints belong to the branch left behind. Their names are recorded in
``abandoned.json`` in the run directory before the run trains, so that:

* resume ``"auto"``/``"latest"`` skips them (saying so): a run killed before its first commit
  resumes from the branch point again, never silently from the abandoned history;
* retention keeps them until the run commits its first checkpoint, then deletes them (they are
  not counted in ``keep_last``; with ``keep_last=None`` nothing is deleted, they stay skipped);
* a resume by name can still return to one (it is then taken off the list).
"""

from __future__ import annotations

import json
from typing import Collection, Sequence

from engine.checkpoint.store.storage import Storage
from engine.errors import CheckpointCorrupt

ABANDONED_FILE = "abandoned.json"
_MAX_BYTES = 4 << 20


def read_abandoned(storage: Storage) -> frozenset[str]:
    """The abandoned checkpoint names recorded in ``storage`` (empty when none are)."""
    if not storage.exists(ABANDONED_FILE):
        return frozenset()
    try:
        data = json.loads(storage.read(ABANDONED_FILE, limit=_MAX_BYTES))
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointCorrupt(f"{ABANDONED_FILE} in {storage.url} is not valid JSON ({error}); it lists the "
                                "checkpoints an earlier resume from an older checkpoint abandoned: restore or "
                                "delete it") from error
    names = data.get("abandoned") if isinstance(data, dict) else None
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise CheckpointCorrupt(f"{ABANDONED_FILE} in {storage.url}: expected {{\"abandoned\": [checkpoint names]}}, "
                                f"got {str(data)[:200]}; restore or delete it")
    return frozenset(names)


def write_abandoned(storage: Storage, names: Collection[str]) -> None:
    """Record ``names`` (the whole list) as abandoned, replacing the file atomically."""
    storage.replace(ABANDONED_FILE, json.dumps({"abandoned": sorted(names)}).encode())


def describe_names(names: Sequence[str], shown: int = 6) -> str:
    """``"ckpt-1, ckpt-2"``, or ``"ckpt-1, ckpt-2, ..., ckpt-9"`` for long lists."""
    ordered = sorted(names)
    if len(ordered) <= shown:
        return ", ".join(ordered)
    return f"{', '.join(ordered[:shown - 1])}, ..., {ordered[-1]}"
