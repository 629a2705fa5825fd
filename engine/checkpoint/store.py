"""The checkpoints of a run directory: commit, list, verify, load, retain.

Layout::

    <run dir>/checkpoints/ckpt-0000000007/{tensors.bin, state.msgpack, progress.msgpack, MANIFEST.json}

Commit protocol (see docs/checkpoint-format.md):

* local filesystem: write the files under ``checkpoints/tmp-<seq>-<pid>`` (same directory, so
  the rename cannot become a copy), fsync each, write and fsync the manifest, fsync the
  directory, rename it to ``ckpt-<seq>``, fsync ``checkpoints/``;
* other filesystems (no atomic rename): write the data files into ``ckpt-<seq>``, then the
  manifest last. Without a valid manifest the directory is not a checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import warnings
import zlib
from typing import Any, Callable

from engine import faults
from engine.checkpoint.codec import EncodedState, decode_state
from engine.checkpoint.manifest import MANIFEST_FILE, FileRecord, Manifest, verify_file
from engine.errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound, CheckpointWriteError
from engine.checkpoint.storage import Storage
from progress import Cursor, ProgressSchemaError, ProgressTree, decode_tree

CHECKPOINT_DIR = "checkpoints"
DATA_FILES = ("tensors.bin", "state.msgpack", "progress.msgpack")
_NAME = re.compile(r"^ckpt-(\d{10})$")
_TEMPORARY = re.compile(r"^tmp-(\d{10})-\d+$")


_OVERLAP_CHECKSUM_BYTES = 8 << 20


def _crc32(chunks: list) -> int:
    crc = 0
    for chunk in chunks:
        crc = zlib.crc32(chunk, crc)
    return crc


def checkpoint_name(sequence: int) -> str:
    return f"ckpt-{sequence:010d}"


@dataclasses.dataclass
class CheckpointInfo:
    """One entry of :meth:`CheckpointStore.inspect`."""

    name: str
    sequence: int
    cursor: Cursor | None
    valid: bool
    error: str | None


@dataclasses.dataclass
class LoadedCheckpoint:
    name: str
    manifest: Manifest
    progress: ProgressTree
    state: Any


StateValidator = Callable[[str, Any], None]


class CheckpointStore:
    def __init__(self, storage: Storage, create: bool = True) -> None:
        self.storage = storage
        if create:
            storage.makedirs(CHECKPOINT_DIR)

    # ---- listing ----------------------------------------------------------------------
    def names(self) -> list[str]:
        """Checkpoint directory names, oldest first (valid or not)."""
        found = [n for n in self.storage.list_names(CHECKPOINT_DIR) if _NAME.match(n)]
        return sorted(found, key=lambda n: int(_NAME.match(n).group(1)))

    def committed_names(self) -> list[str]:
        """Checkpoints whose manifest exists and parses (verified or not): a directory without
        one is an interrupted write, never a checkpoint."""
        return [name for name in self.names() if self._manifest_or_none(name) is not None]

    def next_sequence(self) -> int:
        sequences = [int(m.group(1)) for n in self.storage.list_names(CHECKPOINT_DIR)
                     for m in [(_NAME.match(n) or _TEMPORARY.match(n))] if m]
        return max(sequences, default=0) + 1

    # ---- writing ----------------------------------------------------------------------
    def write(self, encoded: EncodedState, progress_bytes: bytes, cursor: Cursor | None,
              generation: int, sequence: int | None = None, also_sync: list[str] | tuple = (),
              on_data_written: Callable[[], None] | None = None) -> str:
        """Commit one checkpoint; returns its name. On failure nothing partial remains visible.
        ``also_sync`` names other files (metrics.jsonl) made durable in the same fsync batch;
        ``on_data_written`` is called once the tensors' bytes are no longer read."""
        sequence = self.next_sequence() if sequence is None else sequence
        name = checkpoint_name(sequence)
        atomic_rename = self.storage.is_local
        staging = f"tmp-{sequence:010d}-{os.getpid()}" if atomic_rename else name
        directory = f"{CHECKPOINT_DIR}/{staging}"
        renamed = False
        try:
            self.storage.makedirs(directory)
            contents = {
                "tensors.bin": encoded.tensor_chunks(),
                "state.msgpack": [encoded.header],
                "progress.msgpack": [progress_bytes],
            }
            data_paths = [f"{directory}/{file_name}" for file_name in contents]
            # A large state is checksummed in memory while its files reach the disk; a small
            # one inline (one fsync round fewer).
            overlap = atomic_rename and encoded.tensor_bytes >= _OVERLAP_CHECKSUM_BYTES
            records = {}
            for (file_name, chunks), path in zip(contents.items(), data_paths):
                faults.reach("checkpoint_before_file")
                size, crc = self.storage.write(path, chunks, durable=False, checksum=not overlap)
                records[file_name] = FileRecord(size, crc)
                faults.reach("checkpoint_after_file")
            if overlap:
                pending = self.storage.start_sync([*data_paths, directory])
                records = {n: FileRecord(r.size, _crc32(contents[n])) for n, r in records.items()}
            if on_data_written is not None:
                on_data_written()
            if overlap:
                pending.wait()
            faults.reach("checkpoint_before_manifest")
            manifest = Manifest(sequence, cursor, records, time.time(), generation)
            self.storage.write(f"{directory}/{MANIFEST_FILE}", [manifest.to_json()], durable=False)
            if atomic_rename:
                # Everything must be durable before the rename makes it visible.
                unsynced = [] if overlap else data_paths
                self.storage.sync([*unsynced, f"{directory}/{MANIFEST_FILE}", directory, *also_sync])
                faults.reach("checkpoint_before_rename")
                self.storage.rename(directory, f"{CHECKPOINT_DIR}/{name}")
                renamed = True
                faults.reach("checkpoint_after_rename")
                self.storage.fsync_directory(CHECKPOINT_DIR)
        except OSError as error:
            if renamed:  # committed; only the durability of the rename is in doubt
                raise CheckpointWriteError(f"checkpoint {name} is in place but making its rename durable failed: {error}") from error
            self._discard(directory)
            raise CheckpointWriteError(f"writing checkpoint {name} failed: {error}; earlier checkpoints are intact") from error
        except BaseException:
            if not renamed:
                self._discard(directory)
            raise
        return name

    def _discard(self, directory: str) -> None:
        try:
            self.storage.remove_tree(directory)
        except OSError:
            pass  # a partial directory without a manifest is ignored by readers anyway

    def remove_temporaries(self) -> None:
        """Delete staging directories left by crashed writers (call while holding the lease)."""
        for entry in self.storage.list_names(CHECKPOINT_DIR):
            if _TEMPORARY.match(entry):
                self._discard(f"{CHECKPOINT_DIR}/{entry}")

    def apply_retention(self, keep_last: int | None) -> None:
        """Keep the newest ``keep_last`` valid checkpoints; delete older ones (valid or not).
        Directories newer than the oldest kept one are left alone."""
        if keep_last is None:
            return
        kept = 0
        for name in reversed(self.names()):
            if kept >= keep_last:
                faults.reach("checkpoint_retention")
                try:
                    self.storage.remove_tree(f"{CHECKPOINT_DIR}/{name}")
                except OSError as error:  # the new checkpoint is committed; an old one lingers
                    warnings.warn(f"could not delete old checkpoint {name} (keep_last={keep_last}): {error}", stacklevel=2)
            elif self._manifest_or_none(name) is not None:
                kept += 1

    def newest_generation(self) -> int:
        """The writer generation recorded by the newest checkpoint whose manifest parses."""
        for name in reversed(self.names()):
            manifest = self._manifest_or_none(name)
            if manifest is not None:
                return manifest.writer_generation
        return 0

    def _manifest_or_none(self, name: str) -> Manifest | None:
        try:
            return Manifest.from_json(self.storage.read(f"{CHECKPOINT_DIR}/{name}/{MANIFEST_FILE}"))
        except (OSError, CheckpointCorrupt):
            return None

    # ---- reading ----------------------------------------------------------------------
    def load(self, name: str, validate: StateValidator | None = None) -> LoadedCheckpoint:
        """Verify every file against the manifest, then decode, then ``validate(name, state)``
        (the run state's own checks). Raises CheckpointCorrupt."""
        directory = f"{CHECKPOINT_DIR}/{name}"
        manifest = self._read_manifest(name)
        if set(manifest.files) != set(DATA_FILES):
            raise CheckpointCorrupt(f"{name}: the manifest lists {sorted(manifest.files)}, expected {sorted(DATA_FILES)}")
        contents = {}
        for file_name, record in manifest.files.items():
            path = f"{directory}/{file_name}"
            try:
                size = self.storage.size(path)
            except FileNotFoundError as error:
                raise CheckpointCorrupt(f"{name}: {file_name} is missing") from error
            if size != record.size:
                # Checked before reading: a hostile manifest must not make us allocate its size.
                raise CheckpointCorrupt(f"{name}: {file_name}: {size} bytes on disk, the manifest says {record.size} (truncated or torn)")
            data = self.storage.read_into(path, record.size)
            verify_file(file_name, data, record)
            contents[file_name] = data
        try:
            progress = decode_tree(bytes(contents["progress.msgpack"]))
        except ProgressSchemaError as error:
            raise CheckpointCorrupt(f"{name}: progress.msgpack: {error}") from error
        try:
            state = decode_state(bytes(contents["state.msgpack"]), contents["tensors.bin"])
        except CheckpointCorrupt as error:
            raise CheckpointCorrupt(f"{name}: state.msgpack / tensors.bin: {error}") from error
        if validate is not None:
            validate(name, state)
        return LoadedCheckpoint(name, manifest, progress, state)

    def _read_manifest(self, name: str) -> Manifest:
        if not _NAME.match(name):
            raise CheckpointNotFound(f"{name!r} is not a checkpoint name (expected ckpt-NNNNNNNNNN)")
        path = f"{CHECKPOINT_DIR}/{name}/{MANIFEST_FILE}"
        try:
            raw = self.storage.read(path)
        except FileNotFoundError as error:
            if not self.storage.exists(f"{CHECKPOINT_DIR}/{name}"):
                raise CheckpointNotFound(f"no checkpoint {name} in {self.storage.url}") from error
            raise CheckpointCorrupt(f"{name}: no {MANIFEST_FILE} (the write never committed)") from error
        manifest = Manifest.from_json(raw)
        if checkpoint_name(manifest.sequence) != name:
            raise CheckpointCorrupt(f"{name}: the manifest says it is sequence {manifest.sequence}")
        return manifest

    def latest(self, validate: StateValidator | None = None) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies (and passes ``validate``). Newer ones that do
        not are reported with a warning and skipped; None when there is none at all."""
        for name in reversed(self.names()):
            try:
                return self.load(name, validate)
            except CheckpointError as error:
                warnings.warn(f"skipping checkpoint {name}: {error}", stacklevel=2)
        return None

    def inspect(self, validate: StateValidator | None = None) -> list[CheckpointInfo]:
        """Every checkpoint with whether it verifies (and passes ``validate``) and why not."""
        infos = []
        for name in self.names():
            sequence = int(_NAME.match(name).group(1))
            try:
                loaded = self.load(name, validate)
                infos.append(CheckpointInfo(name, sequence, loaded.manifest.cursor, True, None))
            except CheckpointError as error:
                manifest = self._manifest_or_none(name)
                infos.append(CheckpointInfo(name, sequence, manifest.cursor if manifest else None, False, str(error)))
        return infos
