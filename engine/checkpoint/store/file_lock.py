"""Take an ``flock`` on a file without waiting (the writer lease's files, the snapshot arena's owners file)."""

from __future__ import annotations

import fcntl
import os


def try_lock(path: str, open_flags: int, operation: int) -> int | None:
    """``path`` opened with ``open_flags`` and locked with ``operation`` (``fcntl.LOCK_EX`` or
    ``LOCK_SH``; never waits): its descriptor, which holds the lock until closed; None when it
    cannot be opened or another process holds a conflicting lock."""
    try:
        descriptor = os.open(path, open_flags, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, operation | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        return None
    return descriptor
