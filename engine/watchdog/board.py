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
import re
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


def shared_directory(environment: Mapping[str, str], agent: int | None = None) -> str | None:
    """The node's directory of this torchrun job's words (this restart's); None outside torchrun
    or in a job of one process that no launcher watches. ``agent``: the pid of the torchrun agent
    that started the ranks (:func:`torchrun_agent`), part of the name outside a launcher."""
    world_size = environment.get("WORLD_SIZE", "1")
    launcher = launcher_board(environment)
    if not environment.get("RANK", "").isdigit() or not world_size.isdigit() or \
            (int(world_size) <= 1 and launcher is None):
        return None
    root = launcher or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    # The agent's group rank too: two agents of one job on one machine (a test's two "nodes")
    # are two nodes, each with its own words.
    names = [environment.get(name, "0") for name in ("TORCHELASTIC_RUN_ID", "MASTER_PORT", "GROUP_RANK")]
    if launcher is None and agent is not None:
        # The launcher's directory is its own; /dev/shm outlives a job killed whole, and a job
        # requeued under the same rendezvous id and port would read the words its killed
        # predecessor left (a rank flagged as hung ends the new job at once): one directory per
        # agent, i.e. per launch.
        names.append(f"a{agent}")
    job = "-".join([*names, environment.get("TORCHELASTIC_RESTART_COUNT", "0")])
    return os.path.join(root, PREFIX + "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in job))


def torchrun_agent() -> int:
    """The pid of the torchrun agent that started this rank: the nearest ancestor that did not
    start with ``LOCAL_RANK`` in its environment (a wrapper script between the agent and Python
    did); the parent when /proc cannot tell."""
    parent = os.getppid()
    candidate = parent
    for _ in range(_ANCESTORS_LOOKED_AT):
        try:
            with open(f"/proc/{candidate}/environ", "rb") as handle:
                environment = b"\0" + handle.read(_ENVIRONMENT_BYTES)
            with open(f"/proc/{candidate}/stat", "rb") as handle:
                # pid (comm) state ppid ...: comm may hold spaces and parentheses.
                above = int(handle.read().rpartition(b")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return parent
        if b"\0LOCAL_RANK=" not in environment:
            return candidate
        if above <= 1:
            return parent
        candidate = above
    return parent


_ANCESTORS_LOOKED_AT = 8
_ENVIRONMENT_BYTES = 1 << 20
_LAUNCH = re.compile(r"(?P<job>.*)-a(?P<agent>[0-9]+)-(?P<restart>[0-9]+)", re.ASCII)


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
        remove_left_behind(directory)
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
        """Every local rank's word (those written so far); this rank's own alone once the
        directory is gone (a rank that ended on a hang removed the node's words)."""
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            own = words.read(self.buffer)
            return [] if own is None else [own]
        found = []
        for name in names:
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


def remove_left_behind(directory: str) -> None:
    """Remove the words that ranks killed before they could remove their own left on this node
    for this job (``directory``'s job): those of its earlier restarts (torchrun ends every local
    worker of a try before it starts the next), and those of its earlier launches (same
    rendezvous id, port and node) whose agent is no longer alive: a job killed whole. An agent
    pid in use again keeps its directory (the safe side)."""
    parent, name = os.path.split(directory)
    try:
        siblings = os.listdir(parent)
    except OSError:
        return
    for sibling in siblings:
        if _earlier_restart(sibling, name) or _dead_launch(sibling, name):
            shutil.rmtree(os.path.join(parent, sibling), ignore_errors=True)


def _earlier_restart(sibling: str, name: str) -> bool:
    job, _, restart = name.rpartition("-")
    earlier, _, count = sibling.rpartition("-")
    return restart.isdigit() and earlier == job and count.isdigit() and int(count) < int(restart)


def _dead_launch(sibling: str, name: str) -> bool:
    own, other = _LAUNCH.fullmatch(name), _LAUNCH.fullmatch(sibling)
    return own is not None and other is not None and other["job"] == own["job"] and \
        other["agent"] != own["agent"] and not os.path.exists(f"/proc/{other['agent']}")


def remove_words(directory: str, path: str) -> None:
    """Remove this rank's word file, and the directory once no rank's is left."""
    for remove, target in ((os.remove, path), (os.rmdir, directory)):
        try:
            remove(target)
        except OSError:
            pass  # another rank's word is still there, or it is gone already
