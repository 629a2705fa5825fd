"""The manifest: the record that makes a checkpoint exist.

``MANIFEST.json`` is written last. It names the format and version, the sequence number, the
cursor of the last completed split and, for every data file, its size and checksum (CRC-32C;
zlib's CRC-32 in checkpoints of earlier versions, see engine/checkpoint/format/checksum.py).
A checkpoint whose manifest is missing, unparsable, or disagrees with a file does not exist.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from engine.checkpoint.format import checksum as checksums
from engine.checkpoint.format.names import check_name
from engine.errors import CheckpointCorrupt
from progress import Cursor

MANIFEST_FILE = "MANIFEST.json"
FORMAT = "splitloop.checkpoint"
VERSION = 1
MAX_MANIFEST_BYTES = 1 << 20
MAX_GENERATION = (1 << 63) - 1
"""The largest sequence number or writer generation a manifest holds."""


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """A data file's size and checksum; ``algorithm`` names the checksum (its key in the
    manifest: ``{"size": ..., "crc32c": ...}``)."""

    size: int
    crc: int
    algorithm: str = checksums.DEFAULT

    def to_dict(self) -> dict[str, int]:
        return {"size": self.size, self.algorithm: self.crc}


@dataclasses.dataclass(frozen=True)
class MonitorRecord:
    """The monitored metric's value that this checkpoint was taken for (best checkpoints)."""

    name: str
    mode: str  # "min" or "max"
    value: float

    def better_first(self) -> float:
        """A sort key that puts better values first."""
        return self.value if self.mode == "min" else -self.value


@dataclasses.dataclass
class Manifest:
    sequence: int
    cursor: Cursor | None
    files: dict[str, FileRecord]
    created_unix: float
    writer_generation: int
    monitor: MonitorRecord | None = None
    # The identity of the run that wrote it, recorded by a fast tier's checkpoints (a tier is
    # bound to one run: engine.checkpoint.tiers.fast); None elsewhere.
    run: str | None = None
    # Resumable on another world size (engine.distributed.global_order.is_anchor); retention
    # keeps the newest such checkpoint (engine.checkpoint.store.retention).
    anchor: bool = False

    def to_json(self) -> bytes:
        data = {
            "format": FORMAT,
            "version": VERSION,
            "sequence": self.sequence,
            "cursor": None if self.cursor is None else self.cursor.to_dict(),
            "files": {name: record.to_dict() for name, record in self.files.items()},
            "created_unix": self.created_unix,
            "writer_generation": self.writer_generation,
        }
        if self.monitor is not None:
            data["monitor"] = dataclasses.asdict(self.monitor)
        if self.run is not None:
            data["run"] = self.run
        if self.anchor:
            data["anchor"] = True
        # Compact: with an indent, json falls back from its C encoder to Python (~0.2 ms a commit).
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Manifest":
        """Parse and check a manifest; anything malformed raises CheckpointCorrupt."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise CheckpointCorrupt(f"{MANIFEST_FILE} is over {MAX_MANIFEST_BYTES} bytes, larger than any real manifest")
        try:
            data = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
        except (UnicodeDecodeError, ValueError) as error:  # JSONDecodeError is a ValueError
            raise CheckpointCorrupt(f"{MANIFEST_FILE} is not valid JSON: {error}") from error
        except RecursionError as error:
            raise CheckpointCorrupt(f"{MANIFEST_FILE} nests too deeply to be a manifest") from error
        expected = {"format", "version", "sequence", "cursor", "files", "created_unix", "writer_generation"}
        if not isinstance(data, dict) or set(data) - _OPTIONAL_KEYS != expected:
            raise CheckpointCorrupt(f"{MANIFEST_FILE} does not have the keys {sorted(expected)} (and optionally "
                                    f"{' and '.join(map(repr, sorted(_OPTIONAL_KEYS)))})")
        if data["format"] != FORMAT or type(data["version"]) is not int or data["version"] != VERSION:
            raise CheckpointCorrupt(f"{MANIFEST_FILE}: format {data['format']!r} version {data['version']!r} is not {FORMAT!r} {VERSION}")
        try:
            cursor = None if data["cursor"] is None else Cursor.from_dict(data["cursor"])
            if not isinstance(data["files"], dict):
                raise ValueError(f"'files' must be an object, got {type(data['files']).__name__}")
            files = {check_name(name): _file_record(record) for name, record in data["files"].items()}
            monitor = _monitor_record(data["monitor"]) if "monitor" in data else None
            run = _run_identity(data["run"]) if "run" in data else None
            anchor = _anchor(data["anchor"]) if "anchor" in data else False
            return cls(_count(data, "sequence"), cursor, files, _timestamp(data["created_unix"]),
                       _count(data, "writer_generation"), monitor, run, anchor)
        except (ValueError, TypeError, AttributeError, RecursionError) as error:
            raise CheckpointCorrupt(f"{MANIFEST_FILE} is malformed: {error}") from error


_OPTIONAL_KEYS = frozenset({"monitor", "run", "anchor"})
MAX_RUN_IDENTITY = 64


def _run_identity(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_RUN_IDENTITY:
        raise ValueError(f"'run' must be a string of 1 to {MAX_RUN_IDENTITY} characters, got {value!r:.80}")
    return value


def _anchor(value: Any) -> bool:
    if value is not True:
        raise ValueError(f"'anchor' must be true when present, got {value!r:.80}")
    return True


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a key given twice (json keeps the last silently, other
    readers the first: the same file would mean two different checkpoints)."""
    data = dict(pairs)
    if len(data) != len(pairs):
        keys = [key for key, _ in pairs]
        twice = next(key for key in keys if keys.count(key) > 1)
        raise ValueError(f"the key {twice!r} appears twice in one object")
    return data


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a manifest holds")


def _count(data: dict[str, Any], key: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_GENERATION:
        raise ValueError(f"{key!r} must be an int in 0..2**63-1, got {value!r}")
    return value


def _timestamp(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"'created_unix' must be a finite number, got {value!r}")
    return float(value)


def _monitor_record(record: Any) -> MonitorRecord:
    if not isinstance(record, dict) or set(record) != {"name", "mode", "value"}:
        raise ValueError(f"monitor record {record!r} must have exactly name, mode and value")
    name, mode, value = record["name"], record["mode"], record["value"]
    if not isinstance(name, str) or not name or mode not in ("min", "max"):
        raise ValueError(f"monitor record {record!r} has a bad name or mode")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"monitor record {record!r} has a value that is not a finite number")
    return MonitorRecord(name, mode, float(value))


def _file_record(record: Any) -> FileRecord:
    keys = set(record) if isinstance(record, dict) else set()
    algorithms = keys - {"size"}
    if "size" not in keys or len(algorithms) != 1 or not algorithms <= set(checksums.ALGORITHMS):
        raise ValueError(f"file record {record!r} must have exactly size and one checksum "
                         f"({' or '.join(sorted(checksums.ALGORITHMS))})")
    algorithm = algorithms.pop()
    size, crc = record["size"], record[algorithm]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (size, crc)) or crc >= 1 << 32:
        raise ValueError(f"file record {record!r} has a bad size or {algorithm}")
    return FileRecord(size, crc, algorithm)


def verify_file(name: str, data: bytes | bytearray | memoryview, record: FileRecord) -> None:
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size != record.size:
        raise CheckpointCorrupt(f"{name}: {size} bytes on disk, the manifest says {record.size} (truncated or torn)")
    crc = checksums.checksum([data], record.algorithm)
    if crc != record.crc:
        label = "CRC-32C" if record.algorithm == checksums.CRC32C else "CRC-32"
        raise CheckpointCorrupt(f"{name}: {label} {crc:#010x} does not match the manifest's {record.crc:#010x} (corrupted)")
