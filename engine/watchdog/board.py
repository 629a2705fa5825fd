"""Where the progress words live: one anonymous record for a process alone; for the ranks of a
torchrun job, one file per rank in a directory of the node's shared memory (``/dev/shm``), named
after the job's rendezvous and restart, so that every rank's monitor reads every local rank's word.
Under ``python -m engine launch`` the directory lies in the launcher's own (:data:`BOARD_VARIABLE`),
and the launcher reads the words too: it sees a rank that never arrives (engine.watchdog.arrival).

Shared memory, not the process group's store: the store is a TCP server in rank 0's agent, and a
read through it needs that process and the network to answer; a mapped page needs nothing, even
when a rank is stopped. Ranks on other nodes are watched by their own node's monitors.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from typing import Mapping

from engine.watchdog import word as words

PREFIX = "splitloop-watchdog-"
_RANK_FILE = "rank-{rank}"
# Set by ``python -m engine launch``: the directory (its own, in /dev/shm) where its workers'
# words and their hang / crash-loop verdicts (engine.watchdog.verdict_files) are written.
BOARD_VARIABLE = "SPLITLOOP_WATCHDOG_BOARD"


def launcher_board(environment: Mapping[str, str]) -> str | None:
    """The launcher's board directory, when this process runs under ``python -m engine launch``
    (an absolute path to an existing directory; anything else is ignored)."""
    root = environment.get(BOARD_VARIABLE, "")
    return root if os.path.isabs(root) and os.path.isdir(root) else None


def shared_directory(environment: Mapping[str, str]) -> str | None:
    """The node's directory of this torchrun job's words (this restart's); None outside torchrun
    or in a job of one process that no launcher watches."""
    world_size = environment.get("WORLD_SIZE", "1")
    launcher = launcher_board(environment)
    if not environment.get("RANK", "").isdigit() or not world_size.isdigit() or \
            (int(world_size) <= 1 and launcher is None):
        return None
    root = launcher or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    # The agent's group rank too: two agents of one job on one machine (a test's two "nodes")
    # are two nodes, each with its own words.
    job = "-".join(environment.get(name, "0") for name in ("TORCHELASTIC_RUN_ID", "MASTER_PORT", "GROUP_RANK",
                                                          "TORCHELASTIC_RESTART_COUNT"))
    return os.path.join(root, PREFIX + "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in job))


def rank_file(directory: str, rank: int) -> str:
    """Where rank ``rank``'s word lies in ``directory``."""
    return os.path.join(directory, _RANK_FILE.format(rank=rank))


class AloneBoard:
    """The word of a process that trains alone."""

    def __init__(self) -> None:
        self.buffer = words.new_buffer()

    def words(self) -> list[words.Word]:
        word = words.read(self.buffer)
        return [] if word is None else [word]

    def close(self) -> None:
        self.buffer.close()

    def remove_all(self) -> None:
        self.close()


class NodeBoard:
    """The words of the local ranks of a torchrun job (see the module docstring)."""

    def __init__(self, directory: str, rank: int, keep: bool = False) -> None:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        remove_earlier_restarts(directory)
        self.directory = directory
        self.keep = keep  # leave the word (flagged finished) for the launcher, which removes it
        self.path = rank_file(directory, rank)
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(descriptor, words.SIZE)
            self.buffer = mmap.mmap(descriptor, words.SIZE)
        finally:
            os.close(descriptor)
        self._others: dict[str, mmap.mmap] = {}

    def words(self) -> list[words.Word]:
        """Every local rank's word (those written so far)."""
        found = []
        for name in sorted(os.listdir(self.directory)):
            buffer = self._others.get(name) or self._open(name)
            word = None if buffer is None else words.read(buffer)
            if word is not None:
                found.append(word)
        return found

    def _open(self, name: str) -> mmap.mmap | None:
        try:
            with open(os.path.join(self.directory, name), "rb") as handle:
                buffer = mmap.mmap(handle.fileno(), words.SIZE, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return None  # removed meanwhile, or not yet sized
        self._others[name] = buffer
        return buffer

    def close(self) -> None:
        for buffer in self._others.values():
            buffer.close()
        self._others.clear()
        self.buffer.close()
        if not self.keep:
            remove_words(self.directory, self.path)

    def remove_all(self) -> None:
        """Remove every rank's word and the directory (the job ends on a hang)."""
        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def remove_earlier_restarts(directory: str) -> None:
    """Remove the words the earlier restarts of this job left on this node (``directory``'s
    name ends with the restart count): torchrun ends every local worker of a try before it starts
    the next, so the ranks that wrote them are gone, killed before they could remove their own."""
    parent, name = os.path.split(directory)
    job, _, restart = name.rpartition("-")
    if not restart.isdigit():
        return
    try:
        siblings = os.listdir(parent)
    except OSError:
        return
    for sibling in siblings:
        earlier = sibling.rpartition("-")
        if earlier[0] == job and earlier[2].isdigit() and int(earlier[2]) < int(restart):
            shutil.rmtree(os.path.join(parent, sibling), ignore_errors=True)


def remove_words(directory: str, path: str) -> None:
    """Remove this rank's word file, and the directory once no rank's is left."""
    for remove, target in ((os.remove, path), (os.rmdir, directory)):
        try:
            remove(target)
        except OSError:
            pass  # another rank's word is still there, or it is gone already
