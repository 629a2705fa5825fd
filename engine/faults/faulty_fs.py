"""An fsspec filesystem that wraps another and fails its write-type calls on demand.

Every write-type call (open for writing, write, append, mkdir, rename, remove, fsync through
:class:`engine.checkpoint.store.storage.Storage`) is an arrival at the fault point ``filesystem_write``; an
``enospc`` or ``eio`` fault armed there makes that call raise the matching OSError. Reads pass
through untouched.
"""

from __future__ import annotations

from typing import Any

import fsspec

from engine import faults

_WRITE_MODES = ("w", "a", "x", "+")


class FaultyFileSystem(fsspec.AbstractFileSystem):
    """Wraps ``inner``; see the module docstring. Usable on its own in a user's tests."""

    protocol = "faulty"
    cachable = False

    def __init__(self, inner: fsspec.AbstractFileSystem) -> None:
        super().__init__()
        self.inner = inner

    def before_write(self) -> None:
        """One arrival at ``filesystem_write``: raise the OSError armed for it, if any."""
        error = faults.io_error_due("filesystem_write")
        if error is not None:
            raise error

    # -- write-type calls ------------------------------------------------------------
    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if any(flag in mode for flag in _WRITE_MODES):
            self.before_write()
        return self.inner.open(path, mode, **kwargs)

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self.before_write()
        self.inner.pipe_file(path, value, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.before_write()
        self.inner.makedirs(path, exist_ok=exist_ok)

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.before_write()
        self.inner.mv(path1, path2, **kwargs)

    def rm(self, path: str, recursive: bool = False, **kwargs: Any) -> None:
        self.before_write()
        self.inner.rm(path, recursive=recursive, **kwargs)

    def rm_file(self, path: str) -> None:
        self.before_write()
        self.inner.rm_file(path)

    # -- read-type calls pass through ------------------------------------------------
    def _strip_protocol(self, path: str) -> str:
        return self.inner._strip_protocol(path)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self.inner.exists(path, **kwargs)

    def isdir(self, path: str) -> bool:
        return self.inner.isdir(path)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self.inner.ls(path, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> Any:
        return self.inner.info(path, **kwargs)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        return self.inner.cat_file(path, start=start, end=end, **kwargs)


def filesystem_for(url: str) -> fsspec.AbstractFileSystem | None:
    """The filesystem the engine should use for ``url``: wrapped in FaultyFileSystem when a
    ``filesystem_write`` fault is armed, else None (the Storage picks the plain one)."""
    if not faults.armed_at("filesystem_write"):
        return None
    inner, _ = fsspec.core.url_to_fs(url)
    return FaultyFileSystem(inner)
