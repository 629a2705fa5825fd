"""The writer lease: one process at a time writes checkpoints into a run directory.

``<run dir>/writer.lease`` (JSON) names the holder: a random token, a generation number, the
pid and host, and a heartbeat time. A new writer takes the lease only when there is none or the
holder is gone (its pid is dead on this host, or its heartbeat is older than ``stale_after``
seconds for another host); the generation then goes up by one. Before every commit the writer
checks that the lease is still its own, so a relaunched job that took over makes the old one
stop with :class:`WriterConflict` instead of interleaving checkpoints.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from typing import Any

from engine.errors import WriterConflict
from engine.checkpoint.storage import Storage

LEASE_FILE = "writer.lease"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WriterLease:
    def __init__(self, storage: Storage, stale_after: float = 60.0) -> None:
        self._storage = storage
        self._stale_after = stale_after
        self._token = secrets.token_hex(16)
        self._host = socket.gethostname()
        self.generation = 0
        self._last_heartbeat = 0.0

    def _read(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self._storage.read(LEASE_FILE))
        except FileNotFoundError:
            return None
        except (ValueError, OSError):
            return {}  # unreadable: treat as a lease nobody holds
        return data if isinstance(data, dict) else {}

    def _holder_alive(self, lease: dict[str, Any]) -> bool:
        """A malformed lease holds nothing: a writer that crashed mid-write could leave one."""
        try:
            if lease.get("host") == self._host:
                return _pid_alive(int(lease["pid"]))
            return time.time() - float(lease["heartbeat_unix"]) < self._stale_after
        except (KeyError, TypeError, ValueError, OverflowError):
            return False

    def _describe(self, lease: dict[str, Any]) -> str:
        return f"generation {lease.get('generation')} (pid {lease.get('pid')} on {lease.get('host')})"

    def _write(self) -> None:
        record = {"token": self._token, "generation": self.generation, "pid": os.getpid(),
                  "host": self._host, "heartbeat_unix": time.time()}
        self._storage.replace(LEASE_FILE, json.dumps(record).encode())
        self._last_heartbeat = time.monotonic()

    def acquire(self, minimum_generation: int = 0) -> int:
        """Take the lease or raise WriterConflict; returns this writer's generation."""
        current = self._read()
        if current is not None and self._holder_alive(current):
            raise WriterConflict(
                f"{self._storage.url} is being written by {self._describe(current)}; "
                "two writers would interleave checkpoints. Stop the other job first "
                f"(or remove {LEASE_FILE} if you are sure it is gone)"
            )
        previous = current.get("generation", 0) if current else 0
        previous = previous if isinstance(previous, int) and not isinstance(previous, bool) else 0
        self.generation = max(previous, minimum_generation) + 1
        self._write()
        self.verify()  # another writer racing us would have replaced the file
        return self.generation

    def verify(self) -> None:
        """Raise WriterConflict unless the lease is still ours; refresh the heartbeat."""
        current = self._read()
        if not current or current.get("token") != self._token:
            holder = self._describe(current) if current else "nobody (the lease file is gone)"
            raise WriterConflict(
                f"{self._storage.url}: the writer lease now belongs to {holder}; this writer "
                f"(generation {self.generation}) stops without committing"
            )
        if time.monotonic() - self._last_heartbeat > self._stale_after / 3:
            self._write()

    def heartbeat_if_due(self) -> None:
        """Refresh the heartbeat between commits, so that long intervals between checkpoints
        do not make a live writer look stale to another host."""
        if time.monotonic() - self._last_heartbeat > self._stale_after / 3:
            self.verify()

    def release(self) -> None:
        current = self._read()
        if current and current.get("token") == self._token:
            self._storage.remove_file(LEASE_FILE)
