"""The run directory on a non-local fsspec filesystem (``memory://``, object stores): every
call goes through fsspec; nothing is fsynced and a rename is a copy, which the checkpoint commit
protocol accounts for (the manifest, written last, is a checkpoint's commit point)."""

from __future__ import annotations

from typing import Iterable

from engine.checkpoint.format.checksum import write_chunks
from engine.checkpoint.store.storage import FSSPEC, Storage


class FsspecStorage(Storage, kind=FSSPEC):
    """A :class:`Storage` on any fsspec filesystem that is not local. A wrapping filesystem
    (engine.faults.faulty_fs) fails its own write-type calls."""

    def write(self, relative: str, chunks: Iterable[bytes | memoryview], durable: bool,
              checksum: bool = True, exclusive: bool = False) -> tuple[int, int]:
        path = self.writable_path(relative)
        self._refuse_exclusive(exclusive)
        with self.fs.open(path, "xb" if exclusive else "wb") as handle:
            return write_chunks(handle, chunks, checksum)

    def append(self, relative: str, data: bytes) -> None:
        with self.fs.open(self.writable_path(relative), "ab") as handle:
            handle.write(data)

    def read_into(self, relative: str, size: int) -> bytearray:
        return bytearray(self.fs.cat_file(self.path(relative), start=0, end=size + 1))

    def read(self, relative: str, limit: int | None = None) -> bytes:
        path = self.path(relative)
        # A ranged read on an object store: a huge object is not downloaded whole.
        return self.fs.cat_file(path) if limit is None else self.fs.cat_file(path, start=0, end=limit)

    def size(self, relative: str) -> int:
        return int(self.fs.size(self.path(relative)))

    def exists(self, relative: str) -> bool:
        return bool(self.fs.exists(self.path(relative)))

    def truncate(self, relative: str, size: int) -> None:
        path = self.writable_path(relative)
        head = self.fs.cat_file(path)[:size]
        with self.fs.open(path, "wb") as handle:
            handle.write(head)

    def list_names(self, relative: str) -> list[str]:
        path = self.path(relative)
        if not self.fs.exists(path):
            return []
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(path, detail=False)]

    def rename(self, source: str, target: str) -> None:
        self.fs.mv(self.writable_path(source), self.writable_path(target), recursive=True)

    def _move_over(self, source: str, target_path: str) -> None:
        self.fs.mv(self.path(source), target_path)
