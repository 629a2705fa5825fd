"""The memory tier of one rank of a torchrun job: its own parts, and the copies it keeps for a peer.

``CheckpointConfig(local_tier=PATH, peer_copies=1)`` under torchrun. Every rank commits the part
of each checkpoint it writes (rank 0: the main files, which are a whole single-process
checkpoint; rank r > 0: its per-rank files) into node memory, as a checkpoint of its own with
a manifest (sizes, checksums, sequence, writer generation, run identity)::

    PATH/rank-00003/checkpoints/ckpt-<seq>/      rank 3's own parts
    PATH/held-rank-00001/checkpoints/ckpt-<seq>/ rank 1's parts, kept here for it (peer copies)

A rank r>0 part's files are stored under the data-file names of a checkpoint (``tensors.bin``,
``state.msgpack``: its ``rank-<r>.bin`` and ``rank-<r>.msgpack``), so that one store, one
commit protocol and one verification serve every part. Each directory is a
:class:`~engine.checkpoint.tiers.fast.FastTier`: bound to the run, locked by its live process,
fenced by the writer generation that wrote it last (a stale job's parts are deleted unread).

Which rank keeps whose copies, which split is complete, and what a restart assembles is
engine.distributed.memory_commit's (it needs the process group); this module only keeps parts.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterator, Mapping

from engine.checkpoint.format.manifest import Manifest
from engine.checkpoint.format.names import CHECKPOINT_DIR, CHECKPOINT_NAME, sequence_of
from engine.checkpoint.store.catalogue import DATA_FILES
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.request import CheckpointFiles, CommitCallbacks, CommitRequest
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.tiers.fast import FastTier
from engine.errors import CheckpointError

# Complete checkpoints a torchrun job's memory tier keeps per directory when keep_last keeps all.
MEMORY_PARTS_KEPT = 2

# A part's files in its own store: the main files of rank 0, or rank r's two files under the
# names of the first two.
PART_FILES = DATA_FILES


_DIRECTORY = re.compile(r"(rank|held-rank)-([0-9]{5})", re.ASCII)


def describe_parts(root: str) -> list[dict[str, Any]]:
    """What one node's memory tier ``root`` holds, for ``inspect --memory-tier``: one entry per
    part (checkpoint name, rank, ``own`` or ``copy`` kept for that rank, whether it verifies and
    why not), by checkpoint then rank. Reads only; a directory that is no tier gives nothing."""
    storage = Storage(root, create=False)
    found = []
    for directory in sorted(storage.list_names("")):
        match = _DIRECTORY.fullmatch(directory)
        if match is None:
            continue
        store = CheckpointStore(Storage(os.path.join(root, directory), create=False), create=False)
        for name in store.names():
            try:
                store._read_verified(name)
                valid, error = True, None
            except (OSError, CheckpointError) as failure:
                valid, error = False, f"{type(failure).__name__}: {failure}"
            found.append({"name": name, "rank": int(match.group(2)), "kind": "own" if match.group(1) == "rank" else "copy",
                          "directory": directory, "valid": valid, "error": error})
    return sorted(found, key=lambda part: (part["name"], part["rank"], part["kind"]))


def own_directory(root: str, rank: int) -> str:
    return os.path.join(root, f"rank-{rank:05d}")


def held_directory(root: str, owner: int) -> str:
    return os.path.join(root, f"held-rank-{owner:05d}")


class RankTier:
    """One directory of the memory tier: a rank's own parts, or the copies of another rank's."""

    def __init__(self, path: str, run_storage: Storage) -> None:
        self.fast = FastTier(path, run_storage)
        self.store: CheckpointStore = self.fast.store

    @property
    def url(self) -> str:
        return self.fast.storage.url

    def claim(self, previous_generation: int, generation: int) -> None:
        """Keep the parts only when the previous writer generation wrote them (see FastTier.claim)."""
        self.fast.claim(previous_generation, generation)

    def sequences(self) -> list[int]:
        """The sequences of the parts this directory holds with a readable manifest of this run
        (verified only when read: :meth:`read`)."""
        if not self.fast.usable:
            return []
        return sorted(sequence_of(name) for name, manifest in self.store.newest_first()
                      if manifest is not None and manifest.run == self.store.run)

    def newest_sequence(self) -> int:
        """The highest sequence of any part directory here, committed or not (0: none): the next
        sequence must be above it, so that no sequence is ever written twice."""
        names = self.fast.storage.list_names(CHECKPOINT_DIR)
        found = [sequence_of(name) for name in names if CHECKPOINT_NAME.fullmatch(name)]
        return max(found, default=0)

    def write(self, files: CheckpointFiles, sequence: int, generation: int, template: CommitRequest) -> str:
        """Commit a part: ``files`` as checkpoint ``sequence`` (no fsync: node memory)."""
        request = CommitRequest(files, template.cursor, generation, sequence, monitor=template.monitor,
                                anchor=template.anchor)
        return self.store.write(request, CommitCallbacks())

    def read(self, sequence: int) -> tuple[bytes, dict[str, bytearray]]:
        """The part's manifest (as written) and its files, each verified against it; raises
        CheckpointCorrupt (or CheckpointNotFound) when they are not whole."""
        name = f"ckpt-{sequence:010d}"
        manifest, contents = self.store._read_verified(name)
        return manifest.to_json(), contents

    def manifest_of(self, sequence: int) -> bytes:
        """The manifest of the part this process just committed (as written)."""
        return self.store.manifest_of_committed(f"ckpt-{sequence:010d}").to_json()

    def keep(self, manifest_bytes: bytes, contents: Mapping[str, bytearray | memoryview]) -> Manifest:
        """Commit a part received from another rank, after verifying every file against its
        manifest (CheckpointCorrupt when one does not match: nothing is kept)."""
        manifest = Manifest.from_json(manifest_bytes)
        self.store.commit_verified_copy(manifest, contents)
        return manifest

    def retain(self, keep: int, sequence: int) -> None:
        """Keep the newest ``keep`` parts up to ``sequence`` (a complete checkpoint); older ones
        and any above it that never completed are deleted."""
        for name in self._names_beyond(keep, sequence):
            self.store._retire(name)

    def discard(self, sequence: int) -> None:
        """Delete the part of ``sequence`` (its checkpoint did not complete)."""
        name = f"ckpt-{sequence:010d}"
        if self.fast.storage.exists(f"{CHECKPOINT_DIR}/{name}"):
            self.store._retire(name)

    def _names_beyond(self, keep: int, sequence: int) -> Iterator[str]:
        names = sorted((name for name in self.fast.storage.list_names(CHECKPOINT_DIR) if CHECKPOINT_NAME.fullmatch(name)),
                       key=sequence_of, reverse=True)
        kept = 0
        for name in names:
            if sequence_of(name) > sequence:
                continue  # a later checkpoint in flight: its outcome decides
            if kept < keep:
                kept += 1
                continue
            yield name

    def close(self) -> None:
        self.store.close()
        self.fast.release()


class NodeTier:
    """Rank ``rank``'s directories of the memory tier: its own parts, and (with peer copies)
    those it keeps for ``holds_for`` (None: none)."""

    def __init__(self, root: str, run_storage: Storage, rank: int, holds_for: int | None, keep: int) -> None:
        self.root = root
        self.rank = rank
        self.holds_for = holds_for
        self.keep = keep
        self.own = RankTier(own_directory(root, rank), run_storage)
        self.held = None if holds_for is None else RankTier(held_directory(root, holds_for), run_storage)
        # (previous generation, generation) of the writer lease, once rank 0 holds it.
        self.lease: tuple[int, int] | None = None

    def tiers(self) -> list[RankTier]:
        return [self.own] if self.held is None else [self.own, self.held]

    def claim(self, previous_generation: int, generation: int) -> None:
        for tier in self.tiers():
            tier.claim(previous_generation, generation)
        self.lease = (previous_generation, generation)

    def newest_sequence(self) -> int:
        return max(tier.newest_sequence() for tier in self.tiers())

    def inventory(self) -> dict[str, list[int]]:
        """What this rank can offer a restart: ``{"own": [...], "held": [...]}`` sequences."""
        return {"own": self.own.sequences(), "held": [] if self.held is None else self.held.sequences()}

    def close(self) -> None:
        for tier in self.tiers():
            tier.close()
