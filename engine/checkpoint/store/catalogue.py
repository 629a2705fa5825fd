"""The checkpoints of a run directory as readers see them: listed, ordered newest first by
(writer generation, sequence), verified against their manifests, loaded.

Layout::

    <run dir>/checkpoints/ckpt-0000000007/{tensors.bin, state.msgpack, progress.msgpack, MANIFEST.json}

Readers order checkpoints by (writer generation, sequence), so a checkpoint that a stale writer
commits late never outranks one of the writer that took over.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Collection, Iterable

from engine.checkpoint.format.manifest import MANIFEST_FILE, MAX_MANIFEST_BYTES, Manifest, MonitorRecord, verify_file
from engine.checkpoint.format.names import CHECKPOINT_DIR, CHECKPOINT_NAME, STAGING_NAME, sequence_of
from engine.checkpoint.format.rank_files import is_rank_file
from engine.checkpoint.format.state_keys import SIGNATURE, StateValidator
from engine.checkpoint.store.lease import read_fences
from engine.checkpoint.store.storage import Storage
from engine.errors import CheckpointCorrupt, CheckpointError, CheckpointIncompatible, CheckpointNotFound
from progress import Cursor, ProgressSchemaError, ProgressTree, decode_tree

DATA_FILES = ("tensors.bin", "state.msgpack", "progress.msgpack")
# One byte more than a manifest may hold, so that a larger file is refused as such, not read whole.
_MANIFEST_READ_LIMIT = MAX_MANIFEST_BYTES + 1


@dataclasses.dataclass
class CheckpointInfo:
    """One entry of :meth:`CheckpointStore.inspect`."""

    name: str
    sequence: int
    cursor: Cursor | None
    valid: bool
    error: str | None
    monitor: MonitorRecord | None = None
    # The run signature the state records (valid entries only): the CLI shows its world size.
    signature: dict[str, Any] | None = None
    # Resumable on another world size (the manifest's ``anchor``).
    anchor: bool = False


@dataclasses.dataclass
class LoadedCheckpoint:
    name: str
    manifest: Manifest
    progress: ProgressTree
    state: Any
    # Verified bytes of files beyond DATA_FILES (the per-rank parts of a distributed run).
    extra_files: dict[str, bytearray] = dataclasses.field(default_factory=dict)



class CheckpointCatalogue:
    """The checkpoints under ``storage``'s checkpoints/, read-only (CheckpointStore adds the
    writing side)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        # name -> whether it verified; names are never reused, so a result stays true.
        self._verified: dict[str, bool] = {}
        # name -> its manifest as parsed once (a committed checkpoint's files never change).
        self._manifests: dict[str, Manifest] = {}
        # The run this store is bound to (a fast tier: engine.checkpoint.tiers.fast): every manifest
        # it commits records it, and a checkpoint recording another (or none) is never read.
        self.run: str | None = None

    # ---- listing ----------------------------------------------------------------------
    def names(self) -> list[str]:
        """Checkpoint directory names, oldest first (valid or not)."""
        found = [n for n in self.storage.list_names(CHECKPOINT_DIR) if CHECKPOINT_NAME.fullmatch(n)]
        return sorted(found, key=sequence_of)

    def newest_first(self) -> list[tuple[str, Manifest | None]]:
        """Every ``ckpt-*`` name with its manifest (None when it cannot be read or parsed), in
        the order resume tries them: by (writer generation, sequence), newest first. A name
        without a readable manifest sits at its sequence within the newest generation, so a torn
        newest checkpoint is still reported before an older one is used."""
        entries = [(name, self._manifest_or_none(name)) for name in self.names()]
        newest = max((m.writer_generation for _, m in entries if m is not None), default=0)

        def order(entry: tuple[str, Manifest | None]) -> tuple[int, int]:
            name, manifest = entry
            return (newest if manifest is None else manifest.writer_generation, sequence_of(name))

        return sorted(entries, key=order, reverse=True)

    def committed_names(self) -> list[str]:
        """Checkpoints whose manifest exists and parses (verified or not): a directory without
        one is an interrupted write, never a checkpoint."""
        return [name for name in self.names() if self._manifest_or_none(name) is not None]

    def next_sequence(self) -> int:
        sequences = [int(m.group(1)) for n in self.storage.list_names(CHECKPOINT_DIR)
                     for m in [(CHECKPOINT_NAME.fullmatch(n) or STAGING_NAME.fullmatch(n))] if m]
        return max(sequences, default=0) + 1

    def best(self, count: int, monitor: str | None = None) -> list[str]:
        """Up to ``count`` checkpoints that verify and recorded a value of ``monitor`` (default:
        the metric the newest such record names), best first by the mode recorded; ties go to
        the newest. A best one that does not verify is skipped (the next one takes its place)."""
        records = [(name, manifest.monitor) for name, manifest in self.newest_first()
                   if manifest is not None and manifest.monitor is not None]
        if monitor is None and records:
            monitor = records[0][1].name
        ranked = sorted((entry for entry in records if entry[1].name == monitor), key=lambda entry: entry[1].better_first())
        best: list[str] = []
        for name, _ in ranked:
            if len(best) >= count:
                break
            if self.verifies(name):
                best.append(name)
        return best

    def verifies(self, name: str) -> bool:
        """Whether ``name`` loads (every check of :meth:`load`); cached per name."""
        if name not in self._verified:
            try:
                self.load(name)
            except CheckpointError:
                self._verified[name] = False
        return self._verified[name]

    def newest_committed_sequence(self) -> int:
        """The highest sequence among checkpoints whose manifest parses (0 when none)."""
        return max((sequence_of(name) for name, m in self.newest_first() if m is not None), default=0)

    def newest_generation(self) -> int:
        """The highest writer generation recorded by a checkpoint whose manifest parses."""
        return max((m.writer_generation for _, m in self.newest_first() if m is not None), default=0)

    def _manifest_or_none(self, name: str) -> Manifest | None:
        cached = self._manifests.get(name)
        if cached is not None:
            return cached
        try:
            manifest = Manifest.from_json(self.storage.read(f"{CHECKPOINT_DIR}/{name}/{MANIFEST_FILE}", _MANIFEST_READ_LIMIT))
        except (OSError, CheckpointCorrupt):
            return None
        self._manifests[name] = manifest
        return manifest

    # ---- reading ----------------------------------------------------------------------
    def load(self, name: str, validate: StateValidator | None = None) -> LoadedCheckpoint:
        """Verify every file against the manifest, decode, then ``validate(name, state)`` (the
        run state's own checks); a distributed checkpoint's rank parts are decoded and checked
        too (engine.checkpoint.format.rank_parts). Raises CheckpointCorrupt (also for an I/O error, or a file
        where a directory belongs and the reverse)."""
        try:
            loaded = self._load(name, validate)
        except CheckpointCorrupt:
            self._verified[name] = False
            raise
        except CheckpointError:  # before OSError: CheckpointNotFound is a FileNotFoundError
            raise
        except OSError as error:
            self._verified[name] = False
            raise CheckpointCorrupt(f"{name}: cannot be read: {type(error).__name__}: {error}") from error
        self._verified.setdefault(name, True)
        return loaded

    def _load(self, name: str, validate: StateValidator | None) -> LoadedCheckpoint:
        # Imported here: the writer process commits through this module and has no torch.
        from engine.checkpoint.format.codec import decode_state
        from engine.checkpoint.format.rank_parts import check_rank_parts

        manifest, contents = self._read_verified(name)
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
        extra = {file_name: contents[file_name] for file_name in set(manifest.files) - set(DATA_FILES)}
        # What is chosen must load on every rank: each part is decoded here, not first at restore.
        check_rank_parts(name, state, extra, validate)
        return LoadedCheckpoint(name, manifest, progress, state, extra)

    def _read_verified(self, name: str) -> tuple[Manifest, dict[str, bytearray]]:
        """The manifest and the data files of ``name``, each checked against the manifest."""
        directory = f"{CHECKPOINT_DIR}/{name}"
        manifest = self._read_manifest(name)
        self._refuse_if_fenced(name, manifest)
        self._refuse_if_of_another_run(name, manifest)
        extra = set(manifest.files) - set(DATA_FILES)
        if not set(DATA_FILES) <= set(manifest.files) or not all(map(is_rank_file, extra)):
            raise CheckpointCorrupt(f"{name}: the manifest lists {sorted(manifest.files)}, expected {sorted(DATA_FILES)} "
                                    "(and rank-NNNNN.bin/.msgpack parts of a distributed run)")
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
        return manifest, contents

    def _refuse_if_fenced(self, name: str, manifest: Manifest) -> None:
        """A checkpoint committed by a writer after a newer generation took the lease over."""
        for generation, sequence in read_fences(self.storage):
            if manifest.writer_generation < generation and manifest.sequence > sequence:
                raise CheckpointCorrupt(
                    f"{name}: written by writer generation {manifest.writer_generation} after generation "
                    f"{generation} took the lease over at sequence {sequence} (a stale writer); never resumed from"
                )

    def _refuse_if_of_another_run(self, name: str, manifest: Manifest) -> None:
        """In a store bound to a run: a checkpoint that another run wrote (two runs given one
        fast tier), or one that names no run."""
        if self.run is not None and manifest.run != self.run:
            raise CheckpointIncompatible(
                f"{name}: written by another run (run {manifest.run!r}, this run is {self.run!r}) into the "
                f"shared fast tier {self.storage.url}; never resumed from or copied"
            )

    def _read_manifest(self, name: str) -> Manifest:
        if not isinstance(name, str) or not CHECKPOINT_NAME.fullmatch(name):
            raise CheckpointNotFound(f"{name!r} is not a checkpoint name (expected ckpt-NNNNNNNNNN, ten ASCII digits)")
        path = f"{CHECKPOINT_DIR}/{name}/{MANIFEST_FILE}"
        try:
            raw = self.storage.read(path, _MANIFEST_READ_LIMIT)
        except FileNotFoundError as error:
            if not self.storage.exists(f"{CHECKPOINT_DIR}/{name}"):
                raise CheckpointNotFound(f"no checkpoint {name} in {self.storage.url}") from error
            raise CheckpointCorrupt(f"{name}: no {MANIFEST_FILE} (the write never committed)") from error
        except OSError as error:  # ckpt-* is a file, MANIFEST.json a directory, an EIO
            raise CheckpointCorrupt(f"{name}: cannot read {MANIFEST_FILE}: {type(error).__name__}: {error}") from error
        manifest = Manifest.from_json(raw)
        if manifest.sequence != sequence_of(name):
            raise CheckpointCorrupt(f"{name}: the manifest says it is sequence {manifest.sequence}")
        return manifest

    def latest(self, validate: StateValidator | None = None, skip: Collection[str] = ()) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies (and passes ``validate``), newest by (writer
        generation, sequence), leaving out those in ``skip``. Newer ones that do not are
        reported with a warning and skipped; None when there is none at all."""
        candidates = ((self, name) for name, _ in self.newest_first() if name not in skip)
        return first_that_loads(candidates, validate, name_the_store=False, stacklevel=2)

    def inspect(self, validate: StateValidator | None = None) -> list[CheckpointInfo]:
        """Every ``ckpt-*`` entry with whether it verifies (and passes ``validate``) and why
        not, in resume order (oldest first: the last valid entry is what resume picks)."""
        infos = []
        for name, _ in reversed(self.newest_first()):
            sequence = sequence_of(name)
            try:
                loaded = self.load(name, validate)
                signature = loaded.state.get(SIGNATURE) if isinstance(loaded.state, dict) else None
                infos.append(CheckpointInfo(name, sequence, loaded.manifest.cursor, True, None, loaded.manifest.monitor,
                                            signature if isinstance(signature, dict) else None,
                                            loaded.manifest.anchor))
            except CheckpointError as error:
                manifest = self._manifest_or_none(name)
                infos.append(CheckpointInfo(name, sequence, manifest.cursor if manifest else None, False, str(error),
                                            manifest.monitor if manifest else None))
        return infos


def first_that_loads(candidates: Iterable[tuple[CheckpointCatalogue, str]], validate: StateValidator | None,
                     name_the_store: bool, stacklevel: int) -> LoadedCheckpoint | None:
    """The first of ``candidates`` (catalogue, checkpoint name) that verifies and passes
    ``validate``; each one before it that does not is reported with a warning (naming its
    catalogue's storage with ``name_the_store``) and skipped. None when none loads."""
    for catalogue, name in candidates:
        try:
            return catalogue.load(name, validate)
        except CheckpointError as error:
            where = f" in {catalogue.storage.url}" if name_the_store else ""
            warnings.warn(f"skipping checkpoint {name}{where}: {error}", stacklevel=stacklevel + 1)
    return None
