"""The checkpoints of a run directory, for the process that writes them: the catalogue
(engine.checkpoint.store.catalogue) plus committing (engine.checkpoint.store.staged), cleaning up what
crashed writers left, and applying retention (engine.checkpoint.store.retention).

Fencing: the writer's ``fence`` (the lease check) runs immediately before the commit point (the
rename, or the manifest); retention never deletes a checkpoint of a newer generation than the
writer's own.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Collection, Mapping, Sequence

from engine import faults
from engine.checkpoint.format.manifest import MANIFEST_FILE, Manifest, verify_file
from engine.checkpoint.format.names import CHECKPOINT_DIR, STAGING_NAME, checkpoint_name, sequence_of
from engine.checkpoint.store.catalogue import (DATA_FILES, CheckpointCatalogue, CheckpointInfo, LoadedCheckpoint,
                                               StateValidator)
from engine.checkpoint.store.request import NO_CALLBACKS, CheckpointFiles, CommitCallbacks, CommitRequest
from engine.checkpoint.store.retention import retired_by_policy
from engine.checkpoint.store.staged import StagedCheckpoint
from engine.checkpoint.store.storage import Storage
from engine.errors import CheckpointCorrupt, ConfigError

__all__ = ["CHECKPOINT_DIR", "DATA_FILES", "CheckpointInfo", "CheckpointStore", "LoadedCheckpoint", "StateValidator",
           "checkpoint_name"]

_RECYCLABLE_FILES = frozenset((*DATA_FILES, MANIFEST_FILE))


class CheckpointStore(CheckpointCatalogue):
    """A run directory's checkpoints: read them (CheckpointCatalogue), commit new ones, retire
    old ones."""

    def __init__(self, storage: Storage, create: bool = True, durable: bool = True) -> None:
        super().__init__(storage)
        # False for a fast tier (engine.checkpoint.tiers.fast): the same commit protocol and order,
        # without the fsyncs (such a tier survives the process, not the node).
        self.durable = durable
        # A staging directory of this process holding a retired checkpoint's files, which the
        # next write overwrites in place instead of creating files (local filesystems).
        self._spare: str | None = None
        if create:
            storage.makedirs(CHECKPOINT_DIR)

    # ---- writing ----------------------------------------------------------------------
    def write(self, request: CommitRequest, callbacks: CommitCallbacks = NO_CALLBACKS) -> str:
        """Commit one checkpoint (engine.checkpoint.store.staged); returns its name. On failure
        nothing partial remains visible."""
        return self.stage(request, callbacks).commit()

    def stage(self, request: CommitRequest, callbacks: CommitCallbacks = NO_CALLBACKS) -> StagedCheckpoint:
        """Write ``request``'s data files, durable, and return them staged for
        :meth:`StagedCheckpoint.commit` (a distributed run adds the other ranks' files there)."""
        sequence = self.next_sequence() if request.sequence is None else request.sequence
        return StagedCheckpoint.stage(self, request, sequence, callbacks)

    def copy_from(self, source: "CheckpointStore", name: str, also_sync: Sequence[str] = (),
                  fence: Callable[[], None] | None = None) -> str:
        """Commit a copy of ``source``'s checkpoint ``name`` here, under the same name, cursor
        and writer generation (a fast tier's checkpoint made durable). Its files are verified
        against its manifest on the way; CheckpointCorrupt if they do not."""
        manifest, contents = source._read_verified(name)
        return self._commit_copy(manifest, contents, also_sync, fence)

    def manifest_of_committed(self, name: str) -> Manifest:
        """The manifest of a checkpoint this store committed or read."""
        manifest = self._manifests.get(name)
        return manifest if manifest is not None else self._read_manifest(name)

    def commit_verified_copy(self, manifest: Manifest, contents: Mapping[str, bytearray | memoryview]) -> str:
        """Commit a checkpoint received as bytes (a peer's copy, engine.checkpoint.tiers.node):
        its data files are verified against ``manifest`` first (CheckpointCorrupt, nothing
        written, when one is missing, extra or does not match), and committed under its name,
        cursor, writer generation and run."""
        if set(manifest.files) != set(DATA_FILES) or set(contents) != set(DATA_FILES):
            raise CheckpointCorrupt(f"a copy of {checkpoint_name(manifest.sequence)} holds {sorted(contents)}, its manifest "
                                    f"lists {sorted(manifest.files)}; expected {sorted(DATA_FILES)}")
        for file_name, record in manifest.files.items():
            verify_file(file_name, contents[file_name], record)
        self._refuse_if_of_another_run(checkpoint_name(manifest.sequence), manifest)
        return self._commit_copy(manifest, contents, (), None)

    def _commit_copy(self, manifest: Manifest, contents: Mapping[str, bytearray | memoryview], also_sync: Sequence[str],
                     fence: Callable[[], None] | None) -> str:
        chunks: dict[str, list[memoryview | bytes]] = {file_name: [memoryview(contents[file_name])] for file_name in DATA_FILES}
        files = CheckpointFiles(chunks, memoryview(contents["tensors.bin"]).nbytes, known=manifest.files)
        request = CommitRequest(files, manifest.cursor, manifest.writer_generation, manifest.sequence,
                                also_sync=also_sync, monitor=manifest.monitor, anchor=manifest.anchor)
        return self.stage(request, CommitCallbacks(fence=fence)).commit()

    def remember_committed(self, name: str, manifest: Manifest) -> None:
        """Record a checkpoint this store just committed (written from memory, checksummed on
        the way: it verifies)."""
        self._manifests[name] = manifest
        self._verified[name] = True

    def make_staging_directory(self, directory: str, recycle: bool) -> None:
        """Create a staging directory; ``recycle``: rename this process's spare one into place
        when there is one (its files are overwritten in place)."""
        spare, self._spare = self._spare, None
        if recycle and spare is not None:
            # A failure fails this write like any other (the spare is a tmp-* directory, which
            # the next process that takes the lease deletes).
            self.storage.rename(f"{CHECKPOINT_DIR}/{spare}", directory)
            return
        self.storage.makedirs(directory)

    # ---- cleaning up ------------------------------------------------------------------
    def _retire(self, name: str) -> None:
        """Delete checkpoint ``name``; where the storage renames cheaply (a local disk) the first
        one is kept as this process's spare staging directory instead (one rename: it stops being
        a checkpoint at once), provided it holds nothing but plain checkpoint files."""
        directory = f"{CHECKPOINT_DIR}/{name}"
        self._manifests.pop(name, None)
        self._verified.pop(name, None)
        spare = f"tmp-{sequence_of(name):010d}-{os.getpid()}"
        if self._spare is None and self.storage.reuse_directory(directory, f"{CHECKPOINT_DIR}/{spare}",
                                                                 _RECYCLABLE_FILES):
            self._spare = spare  # its stale manifest is harmless: a staging directory is never read
            return
        self.storage.remove_tree(directory)

    def close(self) -> None:
        """Delete this process's spare staging directory (call when the run stops writing)."""
        spare, self._spare = self._spare, None
        if spare is not None:
            self.discard(f"{CHECKPOINT_DIR}/{spare}")

    def discard(self, directory: str) -> None:
        """Remove an uncommitted directory under checkpoints/, as far as it can be."""
        try:
            self.storage.remove_tree(directory)
        except OSError:
            pass  # a partial directory without a manifest is ignored by readers anyway

    def discard_staging(self, staging: str) -> None:
        """Remove an uncommitted staging directory ``tmp-*`` (others are left to readers)."""
        if STAGING_NAME.fullmatch(staging):
            self.discard(f"{CHECKPOINT_DIR}/{staging}")

    def remove_temporaries(self) -> None:
        """Delete staging directories left by crashed writers (call while holding the lease),
        and on S3 the parts of their uploads that never completed."""
        for entry in self.storage.list_names(CHECKPOINT_DIR):
            if STAGING_NAME.fullmatch(entry):
                self.discard(f"{CHECKPOINT_DIR}/{entry}")
        try:
            self.storage.abort_unfinished_uploads(CHECKPOINT_DIR)
        except OSError as error:  # only storage costs are at stake; the bucket's lifecycle rule still applies
            warnings.warn(f"could not abort unfinished uploads under {CHECKPOINT_DIR}/: {error}", stacklevel=2)

    def apply_retention(self, keep_last: int | None, generation: int | None = None,
                        protected: Collection[str] = (), abandoned: Collection[str] = ()) -> None:
        """Keep the newest ``keep_last`` checkpoints that verify, newest by (writer generation,
        sequence); delete the older ones (valid or not), but never one of a newer generation
        than ``generation`` (the caller's) nor one in ``protected`` (the best ones, which do not
        count towards ``keep_last``). Invalid ones newer than the oldest kept are left alone; a
        ``ckpt-*`` without a readable manifest is deleted once older than it. ``abandoned``
        ones (engine.checkpoint.store.abandoned) are deleted and not counted."""
        if keep_last is None:
            return
        for name in retired_by_policy(self.newest_first(), keep_last, generation, protected, abandoned, self.verifies):
            faults.reach("checkpoint_retention")
            try:
                self._retire(name)
            except (OSError, ConfigError) as error:  # the new checkpoint is committed; an old one lingers
                warnings.warn(f"could not delete old checkpoint {name} (keep_last={keep_last}): {error}", stacklevel=2)
