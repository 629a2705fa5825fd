"""Ranks that never arrive: what ``python -m engine launch`` sees in its workers' words.

A rank's own monitor runs only once its ``fit`` has started, and the first phases of a try get
long allowances (a restore from a slow store, a first compilation). A rank that hangs before it
ever trains — importing, loading its data before ``fit``, restoring — keeps the other ranks
waiting for it. The launcher watches every worker of the node from the moment its process
appears (torchrun's children carry ``RANK`` in their environment) and reads its word in the
board the launcher owns (engine.watchdog.board.BOARD_VARIABLE).

A rank has *arrived* once it waits for the others at the start (its word says ``starting``
with the detail ``joining the process group`` or ``waiting for every rank to start``) or has
left the start (it trains). A worker that has not arrived
``timeout_s`` after it appeared — it has no word, or its word still says ``starting`` — while
another rank of the same try on this node has arrived (and so waits for it) *never arrived*. A
node where no rank has arrived blames nobody: the rank the others wait for is elsewhere, and
that node's launcher names it. Torch-free: the launcher must not import torch.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Mapping

from engine.watchdog import word as words
from engine.watchdog.board import rank_file, shared_directory
from engine.watchdog.phases import ARRIVED_AT_START, STARTING
from engine.watchdog.word import FINISHED, Word

_ENVIRONMENT_BYTES = 1 << 20  # /proc/PID/environ is read up to this size


@dataclasses.dataclass(frozen=True)
class Worker:
    """A worker process of the job: its rank, the directory of its try's words, when it appeared."""

    pid: int
    rank: int
    directory: str
    appeared_s: float


@dataclasses.dataclass(frozen=True)
class NeverArrived:
    """``worker`` has not arrived ``waited_s`` after it appeared; ``word``: its word (None: none
    yet, it never reached ``fit``); ``waiting``: the ranks of its try that wait for it."""

    worker: Worker
    word: Word | None
    waited_s: float
    waiting: tuple[int, ...]

    def line(self, host: str) -> str:
        if self.word is None:
            where = "it has published no progress word (it never reached fit: importing, loading data, a hang before fit)"
        else:
            detail = f" ({self.word.detail})" if self.word.detail else ""
            where = f"its word still says {self.word.phase!r}{detail} (restoring, starting its writer)"
        others = ", ".join(str(rank) for rank in self.waiting)
        return (f"rank {self.worker.rank} (pid {self.worker.pid}) on {host} never arrived: {self.waited_s:.0f} s after "
                f"it started {where}, while rank(s) {others} wait for it")


def arrived(word: Word | None) -> bool:
    """Whether a rank with ``word`` has arrived (see the module docstring)."""
    return word is not None and (word.phase != STARTING or word.detail in ARRIVED_AT_START
                                 or bool(word.flags & FINISHED))


def never_arrived(workers: Iterable[Worker], found: Mapping[int, Word | None], arrived_pids: set[int],
                  now_s: float, timeout_s: float) -> list[NeverArrived]:
    """The workers that never arrived at ``now_s``. ``found``: each worker's word by pid (None:
    none); ``arrived_pids``: the workers seen arrived at some look (a word left behind by a
    rank that has ended stays arrived)."""
    by_try: dict[str, list[Worker]] = {}
    for worker in workers:
        by_try.setdefault(worker.directory, []).append(worker)
    late = []
    for members in by_try.values():
        waiting = tuple(sorted(worker.rank for worker in members if worker.pid in arrived_pids))
        if not waiting:
            continue
        for worker in members:
            if worker.pid not in arrived_pids and now_s - worker.appeared_s > timeout_s:
                late.append(NeverArrived(worker, found.get(worker.pid), now_s - worker.appeared_s, waiting))
    return late


class ArrivalWatch:
    """The launcher's look at its workers (see the module docstring): call :meth:`look` with the
    job's running processes and each one's parent, now and then."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._workers: dict[int, Worker] = {}  # pid -> the worker it is
        self._arrived: set[int] = set()
        self._named: set[int] = set()

    def look(self, running: Iterable[int], parents: Mapping[int, int], now_s: float) -> list[NeverArrived]:
        """The workers among ``running`` that never arrived, each returned once."""
        running = set(running)
        for pid in self._workers.keys() - running:  # ended: its pid may come back as another process
            del self._workers[pid]
            self._arrived.discard(pid)
            self._named.discard(pid)
        # Read again at each look until it is one: a process forked but not yet exec'ed still
        # has its parent's environment.
        for pid in running - self._workers.keys():
            worker = _worker(pid, now_s)
            if worker is not None:
                self._workers[pid] = worker
        # A worker's own children (DataLoader workers, the checkpoint writer) inherit its rank.
        current = [self._workers[pid] for pid in sorted(running & self._workers.keys())
                   if parents.get(pid, -1) not in self._workers]
        found = {worker.pid: _read_word(worker) for worker in current}
        # A rank that trained stays arrived (its word may be gone: a rank that ended); one that
        # waits at the start has arrived while it waits, not once it restores after the join.
        self._arrived.update(pid for pid, word in found.items() if word is not None and word.phase != STARTING)
        now_arrived = self._arrived | {pid for pid, word in found.items() if arrived(word)}
        late = [item for item in never_arrived(current, found, now_arrived, now_s, self.timeout_s)
                if item.worker.pid not in self._named]
        self._named.update(item.worker.pid for item in late)
        return late


def _worker(pid: int, now_s: float) -> Worker | None:
    """``pid`` as a worker of a torchrun job (its environment names its rank and try), or None."""
    environment = read_environment(pid)
    if environment is None or "TORCHELASTIC_RUN_ID" not in environment or not environment.get("RANK", "").isdigit():
        return None
    directory = shared_directory(environment)
    return None if directory is None else Worker(pid, int(environment["RANK"]), directory, now_s)


def _read_word(worker: Worker) -> Word | None:
    try:
        with open(rank_file(worker.directory, worker.rank), "rb") as handle:
            data = handle.read(words.SIZE)
    except OSError:
        return None
    if len(data) < words.LAYOUT.size:
        return None
    word = words.read(data, attempts=1)
    return word if word is not None and word.pid == worker.pid else None


def read_environment(pid: int) -> dict[str, str] | None:
    """The environment ``pid`` started with, from /proc (None when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            raw = handle.read(_ENVIRONMENT_BYTES)
    except OSError:
        return None
    found = {}
    for entry in raw.split(b"\0"):
        name, equals, value = entry.partition(b"=")
        if equals:
            found[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return found
