"""The words of the other nodes, through the process group's store.

The node's shared memory shows a monitor its own node's ranks only. When every rank of a node
waits in a collective, the rank they wait for is on another node: to name it, each node's lowest
rank publishes its node's words in the store of the group (the torchrun agent's TCPStore, under
the namespace of this try, so a dead try's keys are never read), once per poll, and a monitor
reads the other nodes' words when its own node is stalled. A word crosses nodes as how long its
phase has lasted when it was published (monotonic clocks of two nodes cannot be compared) and
when it was published (wall clock): a node that stopped publishing (stopped whole, or its
network gone) shows as such.

Every store operation runs on a helper thread the monitor waits for at most
:data:`STORE_WAIT_S`: the store is a server in one agent on one node, and a monitor must never hang
on it. JSON, never pickle: the words come from other machines. Only a job on several nodes
(``LOCAL_WORLD_SIZE`` below ``WORLD_SIZE``) publishes; torch is imported only then.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from engine.watchdog.word import Word

KEY_PREFIX = "splitloop/watchdog/node/"
STORE_WAIT_S = 5.0
_MAX_VALUE_BYTES = 1 << 20
_FIELDS = ("sequence", "splits", "timeout_s", "p50_s", "p99_s", "busy_s", "pid", "rank", "phase_code", "flags",
           "detail")


@dataclasses.dataclass(frozen=True)
class RemoteWord:
    """A word of another node as read: the word (its ``started_ns`` on this node's clock), the
    node's host and how old the publication is."""

    word: Word
    host: str
    age_s: float


def encode(local: Sequence[Word], host: str, now_ns: int, wall_s: float) -> bytes:
    """The node's words as published."""
    rows = [{**{name: getattr(word, name) for name in _FIELDS}, "stalled_s": word.stalled_s(now_ns)} for word in local]
    return json.dumps({"host": host, "wall_s": wall_s, "words": rows}).encode()


def decode(data: bytes, now_ns: int, wall_s: float) -> list[RemoteWord]:
    """The words of one publication, placed on this node's clock; a malformed one gives none."""
    try:
        record = json.loads(data[:_MAX_VALUE_BYTES])
        host, published = str(record["host"]), float(record["wall_s"])
        age = max(0.0, wall_s - published)
        found = []
        for row in record["words"]:
            values = {name: row[name] for name in _FIELDS}
            if not all(isinstance(values[name], int) and not isinstance(values[name], bool)
                       for name in ("sequence", "splits", "pid", "rank", "phase_code", "flags")):
                continue
            stalled = float(row["stalled_s"]) + age
            word = Word(started_ns=now_ns - int(stalled * 1e9), **{**values, "detail": str(values["detail"]),
                        **{name: float(values[name]) for name in ("timeout_s", "p50_s", "p99_s", "busy_s")}})
            found.append(RemoteWord(word, host, age))
        return found
    except (ValueError, KeyError, TypeError, AttributeError):
        return []


class RemoteBoard:
    """Publishes this node's words and reads the other nodes' (see the module docstring).
    ``store``: a callable giving the store once the group is joined (None before)."""

    def __init__(self, store: Callable[[], Any], rank: int, world_size: int, host: str | None = None) -> None:
        self._store = store
        self.rank, self.world_size = rank, world_size
        self.host = host or socket.gethostname()
        self.hosts: dict[int, str] = {}  # rank -> host, of the remote words last read
        self.ages: dict[int, float] = {}  # rank -> seconds since its node last published, at that read

    def publish(self, local: Sequence[Word], now_ns: int) -> None:
        """This node's words (by its lowest rank only: one key per node)."""
        if not local or self.rank != min(word.rank for word in local):
            return
        value = encode(local, self.host, now_ns, time.time())
        _bounded(lambda store: store.set(f"{KEY_PREFIX}{self.rank}", value), self._store)

    def read(self, local: Sequence[Word], now_ns: int) -> list[RemoteWord]:
        """The other nodes' words (none when the store does not answer in time)."""
        own = {word.rank for word in local}

        def fetch(store: Any) -> list[bytes]:
            found = []
            for rank in range(self.world_size):
                key = f"{KEY_PREFIX}{rank}"
                if rank not in own and store.check([key]):
                    found.append(bytes(store.get(key)))
            return found

        values = _bounded(fetch, self._store) or []
        remote = [item for value in values for item in decode(value, now_ns, time.time()) if item.word.rank not in own]
        self.hosts = {item.word.rank: item.host for item in remote}
        self.ages = {item.word.rank: item.age_s for item in remote}
        return remote


def _bounded(operation: Callable[[Any], Any], store_of: Callable[[], Any]) -> Any:
    """``operation(store)`` on a helper thread, waited for at most STORE_WAIT_S; None when there
    is no store yet, it fails, or it does not answer in time."""
    store = store_of()
    if store is None:
        return None
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(operation(store))
        except Exception:  # noqa: BLE001 - a store that fails is a store that does not answer
            pass

    helper = threading.Thread(target=run, name="splitloop-watchdog-store", daemon=True)
    helper.start()
    helper.join(STORE_WAIT_S)
    return result[0] if result else None


def several_nodes(environment: Mapping[str, str]) -> bool:
    """Whether this torchrun worker's job spans several nodes."""
    world, local = environment.get("WORLD_SIZE", "1"), environment.get("LOCAL_WORLD_SIZE", "")
    return world.isdigit() and local.isdigit() and int(local) < int(world)


def group_store() -> Any:
    """The default process group's store once the group is joined (the engine's per-try
    namespace of the agent's store), else None."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()
