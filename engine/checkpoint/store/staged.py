"""Writing one checkpoint atomically: the commit protocol (see docs/checkpoint-format.md).

* local filesystem: write the files under ``checkpoints/tmp-<seq>-<pid>`` (same directory, so
  the rename cannot become a copy), fsync each, write and fsync the manifest, fsync the
  directory, rename it to ``ckpt-<seq>``, fsync ``checkpoints/``;
* other filesystems (no atomic rename): write the data files into ``ckpt-<seq>``, then the
  manifest last. Without a valid manifest the directory is not a checkpoint. On object stores
  that can create an object only if absent (S3: ``If-None-Match: *``) every file, the manifest
  above all, is created that way: a writer that finds a name taken was overtaken by another
  writer and stops (WriterConflict) without overwriting or deleting anything of it.

It runs in two steps: :meth:`StagedCheckpoint.stage` writes the data files (durable before it
returns), :meth:`StagedCheckpoint.commit` adds the files other ranks wrote into the same staging
directory, writes the manifest and makes the checkpoint visible. In between, nothing of it is
visible; :meth:`StagedCheckpoint.discard` drops it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Protocol, TypeVar

from engine import faults
from engine.checkpoint.format import checksum as checksums
from engine.checkpoint.format.manifest import MANIFEST_FILE, FileRecord, Manifest
from engine.checkpoint.format.names import CHECKPOINT_DIR, checkpoint_name
from engine.checkpoint.store.request import CheckpointFiles, CommitCallbacks, CommitRequest
from engine.checkpoint.store.storage import DirectoryFiles, Storage
from engine.errors import CheckpointWriteError, WriterConflict

_OVERLAP_CHECKSUM_BYTES = 8 << 20
_Result = TypeVar("_Result")


class StagingArea(Protocol):
    """What the commit protocol needs of the store it commits into
    (engine.checkpoint.store.checkpoint_store.CheckpointStore)."""

    storage: Storage
    # False: no fsyncs (a fast tier).
    durable: bool
    # The run's identity the manifest records (None: none recorded).
    run: str | None

    def make_staging_directory(self, directory: str, recycle: bool) -> None:
        """Create a staging directory (``recycle``: reuse this process's spare one)."""
        ...

    def discard(self, directory: str) -> None:
        """Remove an uncommitted directory under checkpoints/, as far as it can be."""
        ...

    def remember_committed(self, name: str, manifest: Manifest) -> None:
        """Record a checkpoint just committed."""
        ...


@dataclasses.dataclass
class _Written:
    """How far one commit got: its open staging files (local filesystems), the data files'
    records, whether their checksums overlap the fsyncs, whether the rename happened."""

    local: DirectoryFiles | None = None
    records: dict[str, FileRecord] = dataclasses.field(default_factory=dict)
    overlap: bool = False
    renamed: bool = False


class StagedCheckpoint:
    """One checkpoint's data files in their staging directory, not yet committed."""

    def __init__(self, store: StagingArea, request: CommitRequest, sequence: int, directory: str,
                 callbacks: CommitCallbacks) -> None:
        self._store, self._request, self._callbacks = store, request, callbacks
        self.sequence, self.name, self.directory = sequence, checkpoint_name(sequence), directory
        # Object stores that create only what is absent: every file is created exclusively.
        self._exclusive = not store.storage.rename_is_atomic and store.storage.exclusive_create
        self._written = _Written()

    @classmethod
    def stage(cls, store: StagingArea, request: CommitRequest, sequence: int,
              callbacks: CommitCallbacks) -> StagedCheckpoint:
        """Write ``request``'s data files under checkpoints/ as checkpoint ``sequence``, durable
        before this returns (where the store is durable); ``callbacks``: the fence before the
        commit point, the release of the data once written."""
        atomic_rename = store.storage.rename_is_atomic
        # A staging directory shared by several ranks already holds their parts: never recycled.
        recycle = atomic_rename and request.staging is None
        staging = request.staging
        if staging is None:
            staging = f"tmp-{sequence:010d}-{os.getpid()}" if atomic_rename else checkpoint_name(sequence)
        staged = cls(store, request, sequence, f"{CHECKPOINT_DIR}/{staging}", callbacks)
        staged._guarded(lambda: staged._write_data(request.files, recycle))
        return staged

    def commit(self, other_files: dict[str, FileRecord] | None = None) -> str:
        """Write the manifest (listing ``other_files`` too: the other ranks' durable files in
        this staging directory) and make the checkpoint visible at its commit point; its name."""
        manifest = self._guarded(lambda: self._make_visible(other_files or {}))
        self._store.remember_committed(self.name, manifest)
        return self.name

    def discard(self) -> None:
        """Drop the uncommitted checkpoint (its staging directory and open files)."""
        self._store.discard(self.directory)
        self._close()

    def _guarded(self, step: Callable[[], _Result]) -> _Result:
        """Run a step of the protocol; on failure nothing partial stays visible, and an OSError
        becomes the typed error that says what is intact."""
        try:
            return step()
        except OSError as error:
            self._close()
            name = self.name
            if self._exclusive and isinstance(error, FileExistsError):
                # Another writer created this name first: its files are not ours to delete.
                raise WriterConflict(
                    f"{self._store.storage.url}: {name} already holds a file another writer created ({error}); "
                    "this writer was overtaken and stops without committing or deleting anything"
                ) from error
            if self._written.renamed:  # committed; only the durability of the rename is in doubt
                raise CheckpointWriteError(f"checkpoint {name} is in place but making its rename durable failed: {error}") from error
            self._store.discard(self.directory)
            raise CheckpointWriteError(f"writing checkpoint {name} failed: {error}; earlier checkpoints are intact") from error
        except BaseException:
            if not self._written.renamed:
                self._store.discard(self.directory)
            self._close()
            raise

    def _close(self) -> None:
        local, self._written.local = self._written.local, None
        if local is not None:
            local.close()

    def _write_data(self, files: CheckpointFiles, recycle: bool) -> None:
        store, directory = self._store, self.directory
        store.make_staging_directory(directory, recycle=recycle)
        local = self._written.local = store.storage.local_files(directory) if store.storage.rename_is_atomic else None
        # A large state is checksummed in memory while its files reach the disk; a small one
        # inline (one fsync round fewer).
        overlap = self._written.overlap = local is not None and store.durable and files.tensor_bytes >= _OVERLAP_CHECKSUM_BYTES
        checksum = not overlap and files.known is None
        records = {}
        for file_name, chunks in files.contents.items():
            faults.reach("checkpoint_before_file")
            if local is not None:
                size, crc = local.write(file_name, chunks, checksum=checksum)
            else:
                size, crc = store.storage.write(f"{directory}/{file_name}", chunks, durable=False,
                                                checksum=checksum, exclusive=self._exclusive)
            records[file_name] = FileRecord(size, crc)
            faults.reach("checkpoint_after_file")
        if overlap:
            assert local is not None
            pending = local.start_sync([directory])
        known = files.known
        if known is not None:
            records = {n: FileRecord(r.size, known[n].crc, known[n].algorithm) for n, r in records.items()}
        elif overlap:
            records = {n: FileRecord(r.size, checksums.checksum(files.contents[n])) for n, r in records.items()}
        if self._callbacks.on_data_written is not None:
            self._callbacks.on_data_written()
        if overlap:
            pending.wait()
        self._written.records = records

    def _make_visible(self, other_files: dict[str, FileRecord]) -> Manifest:
        store, request, directory = self._store, self._request, self.directory
        records = {**self._written.records, **other_files}
        faults.reach("checkpoint_before_manifest")
        manifest = Manifest(self.sequence, request.cursor, records, time.time(), request.generation,
                            request.monitor, store.run, request.anchor)
        local = self._written.local
        if local is None:
            if self._callbacks.fence is not None:
                self._callbacks.fence()  # the manifest is the commit point here
            store.storage.write(f"{directory}/{MANIFEST_FILE}", [manifest.to_json()], durable=False,
                                exclusive=self._exclusive)
            return manifest
        local.write(MANIFEST_FILE, [manifest.to_json()], checksum=False)
        # Everything must be durable before the rename makes it visible (the data files'
        # descriptors again when they were not synced above: fsync is cheap on a clean file).
        if store.durable:
            if self._written.overlap:
                local.start_sync([directory, *request.also_sync]).wait()
            else:
                local.sync([directory, *request.also_sync])
        faults.reach("checkpoint_before_rename")
        if self._callbacks.fence is not None:
            self._callbacks.fence()
        store.storage.rename(directory, f"{CHECKPOINT_DIR}/{self.name}")
        self._written.renamed = True
        faults.reach("checkpoint_after_rename")
        if store.durable:
            store.storage.fsync_directory(CHECKPOINT_DIR)
        self._close()
        return manifest
