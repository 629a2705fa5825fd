"""A run directory on any fsspec filesystem, behind a small protocol with string paths.

:class:`Storage` is the protocol; constructing it picks one implementation from the URL (or the
filesystem given), once, as :class:`pathlib.Path` picks its flavour:

- :class:`~engine.checkpoint.store.local_storage.LocalStorage` for local paths (``/abs``,
  ``relative``, ``file://...``): real durability (files are fsynced, renames are atomic on one
  filesystem) and the hostile-file protections of a directory others can write into.
- :class:`~engine.checkpoint.store.fsspec_storage.FsspecStorage` for other filesystems
  (``memory://``, object stores): no atomic rename, which the checkpoint commit protocol
  accounts for.
- :class:`~engine.checkpoint.store.s3_storage.S3Storage` for ``s3://bucket/prefix`` run directories,
  through ``s3fs`` (``pip install 'splitloop[s3]'``), configured from the standard AWS
  environment (see docs/object-stores.md). There a file can be created only if absent (a
  conditional ``PutObject``/``CompleteMultipartUpload`` with ``If-None-Match: *``):
  :meth:`Storage.write` with ``exclusive=True``; and an object can be replaced only if it is
  still the version read (``If-Match: <ETag>``): :meth:`Storage.version` then
  :meth:`Storage.replace_prefix_if_unchanged`.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import ClassVar, Collection, Iterable, Protocol

import fsspec
from fsspec.implementations.local import LocalFileSystem

from engine.checkpoint.format.names import check_name
from engine.errors import ConfigError

OBJECT_STORE_PROTOCOLS = ("s3", "s3a")
# The implementations, by kind: each registers itself (``class LocalStorage(Storage, kind=LOCAL)``)
# and engine.checkpoint.store imports all of them, so this module imports none.
LOCAL, FSSPEC, OBJECT_STORE = "local", "fsspec", "object store"
_KINDS: dict[str, type[Storage]] = {}


def open_filesystem(url: str, field: str = "run_dir") -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of ``url`` and the path inside it. ``s3://`` URLs get an s3fs
    filesystem without a listings cache (other processes write the same run directory, and a
    cached listing would hide their checkpoints), its endpoint read from ``AWS_ENDPOINT_URL_S3``
    or ``AWS_ENDPOINT_URL`` when set. Raises ConfigError when s3fs is missing."""
    protocol = url.split("://", 1)[0].lower() if "://" in url else ""
    if protocol not in OBJECT_STORE_PROTOCOLS:
        return fsspec.core.url_to_fs(url)
    try:
        import s3fs  # noqa: F401  (fsspec imports it by name; checked here for a clear message)
    except ImportError as error:
        raise ConfigError(
            f"{field}: {url!r} is an S3 URL, which needs the s3fs package: "
            "pip install 'splitloop[s3]' (or pip install s3fs)"
        ) from error
    options: dict[str, object] = {"use_listings_cache": False}
    # botocore >= 1.31 reads these itself; passing them keeps older installations right too.
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_url"] = endpoint
    return fsspec.core.url_to_fs(url, **options)


class UnreadableFile(OSError):
    """A path in the run directory that the engine refuses to read: not a regular file (a FIFO
    would block the reader, a device never ends), or a symbolic link leading out of the run
    directory. An OSError, so every reader treats it as the I/O error it stands for."""


def _check_url(url: str) -> None:
    if not isinstance(url, str) or not url:
        raise ConfigError(f"run_dir: expected a non-empty path or URL, got {url!r}")
    if "::" in url:
        # fsspec reads "a::b" as a chained URL (a cache in front of b, say): two runs could
        # share one directory, and a caching layer would serve a stale writer lease.
        raise ConfigError(
            f"run_dir: {url!r} contains '::', which fsspec reads as a chained URL (such as "
            "simplecache::s3://...); caches in front of the run directory would hide other "
            "writers. Use a plain path or a single-protocol URL (rename a directory with '::')"
        )


def _implementation(filesystem: fsspec.AbstractFileSystem) -> type[Storage]:
    """The Storage class for ``filesystem``. A wrapping filesystem (engine.faults.faulty_fs)
    keeps the kind of the filesystem it wraps."""
    inner = getattr(filesystem, "inner", filesystem)
    if isinstance(inner, LocalFileSystem):
        return _KINDS[LOCAL]
    protocols = inner.protocol if isinstance(inner.protocol, (tuple, list)) else (inner.protocol,)
    if any(protocol in OBJECT_STORE_PROTOCOLS for protocol in protocols):
        return _KINDS[OBJECT_STORE]
    return _KINDS[FSSPEC]


class Storage:
    """Files under one root directory, addressed by relative '/'-separated names.

    ``Storage(url, filesystem=None, create=True)`` returns the implementation for ``url``
    (see the module docstring); ``filesystem`` overrides the one the URL names (a wrapping
    filesystem that injects faults, say). ``create`` makes the root directory; without it a
    missing root is a ConfigError. The methods that raise NotImplementedError here are each
    implementation's own."""

    # A local filesystem: plain files (fsync, flock, O_NOFOLLOW fast paths).
    is_local: ClassVar[bool] = False
    # Where a rename is atomic, it is a checkpoint's commit point; elsewhere (object stores)
    # the manifest, written last, is. Today exactly the local filesystems.
    rename_is_atomic: ClassVar[bool] = False
    # Object stores that refuse to create an object that exists (If-None-Match: *).
    exclusive_create: ClassVar[bool] = False

    url: str
    fs: fsspec.AbstractFileSystem
    root: str

    def __init_subclass__(cls, kind: str | None = None, **options: object) -> None:
        super().__init_subclass__(**options)
        if kind is not None:
            _KINDS[kind] = cls

    def __new__(cls, url: str, filesystem: fsspec.AbstractFileSystem | None = None, create: bool = True) -> Storage:
        _check_url(url)
        if filesystem is None:
            filesystem, root = open_filesystem(url)
        else:
            root = filesystem._strip_protocol(url)
        kind = _implementation(filesystem) if cls is Storage else cls
        storage = super().__new__(kind)
        storage.url = url
        storage.fs = filesystem
        storage.root = root.rstrip("/") or "/"
        storage._setup()
        if create:
            storage.fs.makedirs(storage.root, exist_ok=True)
        elif not storage.fs.isdir(storage.root):
            raise ConfigError(f"run directory {url!r} does not exist")
        return storage

    def __getnewargs__(self) -> tuple[str, fsspec.AbstractFileSystem, bool]:
        # Unpickled through __new__ as well, on the same filesystem, without creating the root.
        return self.url, self.fs, False

    def __getstate__(self) -> dict[str, object]:
        # Per-process caches and thread pools are made again where the copy is used.
        state = dict(self.__dict__)
        state.pop("_sync_pool", None)
        state.pop("_real_paths", None)
        return state

    def _setup(self) -> None:
        """Per-implementation state, set before the root directory is made or checked."""

    def path(self, relative: str) -> str:
        """The filesystem path of the run-directory-relative ``relative`` ("" is the root);
        ConfigError for a component that is not a plain name."""
        if relative == "":
            return self.root
        parts = relative.split("/")
        for part in parts:
            check_name(part, "path component")
        return "/".join([self.root, *parts])

    def writable_path(self, relative: str) -> str:
        """The path of ``relative`` for a write-type call (see LocalStorage for the checks)."""
        return self.path(relative)

    def makedirs(self, relative: str) -> None:
        self.fs.makedirs(self.writable_path(relative), exist_ok=True)

    def remove_tree(self, relative: str) -> None:
        path = self.writable_path(relative)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def reuse_directory(self, source: str, target: str, allowed_files: Collection[str]) -> bool:
        """Rename directory ``source`` to ``target`` when a rename is cheap here and ``source``
        holds nothing but plain files named in ``allowed_files``; False (nothing done) otherwise.
        Here (not a local disk): always False, the caller deletes instead."""
        return False

    def remove_file(self, relative: str) -> None:
        path = self.writable_path(relative)
        if self.fs.exists(path):
            self.fs.rm_file(path)

    def replace(self, relative: str, data: bytes) -> None:
        """Replace a small file whole: write a temporary sibling, then rename over the target
        (atomic on a local filesystem)."""
        temporary = f"{relative}.{os.getpid()}.tmp"
        target = self.writable_path(relative)
        try:
            self.write(temporary, [data], durable=True)
            self._move_over(temporary, target)
        except BaseException:
            # ENOSPC half-way must not leave the temporary behind (it would outlive the run).
            try:
                self.remove_file(temporary)
            except OSError:
                pass
            raise

    def _refuse_exclusive(self, exclusive: bool) -> None:
        if exclusive and not self.exclusive_create:
            raise ValueError(f"{self.url}: this filesystem cannot create a file only if absent")

    def sync(self, relatives: Iterable[str]) -> None:
        """fsync files and directories (local filesystems only), concurrently: the kernel
        batches concurrent fsyncs into fewer journal commits, which halves the wait."""
        self.start_sync(relatives).wait()

    def start_sync(self, relatives: Iterable[str]) -> PendingSync:
        """Like :meth:`sync`, but returns at once; ``wait()`` on the result. Nothing to do
        where files are not fsynced (object stores)."""
        return PendingSync([])

    def fsync_directory(self, relative: str) -> None:
        """Make a rename or a new file in ``relative`` durable (local filesystems only)."""

    def local_files(self, directory: str) -> DirectoryFiles:
        """Write a checkpoint's files into the local ``directory`` through kept descriptors
        (local filesystems only); see engine.checkpoint.store.local_storage.LocalDirectoryFiles."""
        raise AssertionError("local fast path on a non-local filesystem")

    def abort_unfinished_uploads(self, relative: str) -> int:
        """Abort the multipart uploads under ``relative`` that never completed (S3 only: a
        process killed while it uploaded a large file leaves its parts stored, invisible and
        billed). Call only while no other live process writes there. Returns how many."""
        return 0

    def version(self, relative: str) -> tuple[int, str | None]:
        """An object's size and version (its ETag); ``(0, None)`` when it does not exist. Only
        where :attr:`exclusive_create` is true; see :meth:`replace_prefix_if_unchanged`."""
        raise ValueError(f"{self.url}: this filesystem has no conditional writes")

    def replace_prefix_if_unchanged(self, relative: str, keep: int, data: bytes, version: str | None) -> bool:
        """Replace an object with its first ``keep`` bytes followed by ``data``, only if it is
        still ``version`` (from :meth:`version`; None: only if it does not exist). False when
        another writer changed the object since ``version`` was read, and nothing was changed.
        Only where :attr:`exclusive_create` is true."""
        raise ValueError(f"{self.url}: this filesystem has no conditional writes")

    def write(self, relative: str, chunks: Iterable[bytes | memoryview], durable: bool,
              checksum: bool = True, exclusive: bool = False) -> tuple[int, int]:
        """Write ``chunks`` to a new file; returns (size, CRC-32C) (0 when ``checksum`` is
        False). ``durable`` fsyncs local files. ``exclusive`` creates the file only if it does
        not exist, atomically, and raises FileExistsError otherwise (and leaves the existing
        file alone); only where :attr:`exclusive_create` is true (ValueError elsewhere; on S3 a
        multipart upload checks the condition when it completes)."""
        raise NotImplementedError

    def append(self, relative: str, data: bytes) -> None:
        """Append to a file (durability is the caller's: see :meth:`sync`)."""
        raise NotImplementedError

    def read_into(self, relative: str, size: int) -> bytearray:
        """Read a file expected to hold ``size`` bytes into a new bytearray (no extra copy);
        the result is shorter or the read stops early when the file is not that size."""
        raise NotImplementedError

    def read(self, relative: str, limit: int | None = None) -> bytes:
        """The content of a file, at most its first ``limit`` bytes when a limit is given (the
        caller refuses a longer file as too large to be what it expects)."""
        raise NotImplementedError

    def size(self, relative: str) -> int:
        """A file's size in bytes."""
        raise NotImplementedError

    def exists(self, relative: str) -> bool:
        """Whether ``relative`` exists."""
        raise NotImplementedError

    def truncate(self, relative: str, size: int) -> None:
        """Cut a file to its first ``size`` bytes."""
        raise NotImplementedError

    def list_names(self, relative: str) -> list[str]:
        """Names directly under a directory (empty if it does not exist)."""
        raise NotImplementedError

    def rename(self, source: str, target: str) -> None:
        """Atomic on a local filesystem (one ``os.rename``); a copy elsewhere."""
        raise NotImplementedError

    def _move_over(self, source: str, target_path: str) -> None:
        """Move the file ``source`` over the path ``target_path`` (see :meth:`replace`)."""
        raise NotImplementedError


class PendingSync:
    """fsyncs running in background threads (fsync releases the GIL)."""

    def __init__(self, futures: list[Future[None]]) -> None:
        self._futures = futures

    def wait(self) -> None:
        """Block until every fsync finished; re-raise the first error."""
        errors = [future.exception() for future in self._futures]
        for error in errors:
            if error is not None:
                raise error


class DirectoryFiles(Protocol):
    """The files of one new checkpoint written into a local directory through kept descriptors
    (:meth:`Storage.local_files`; engine.checkpoint.store.local_storage.LocalDirectoryFiles)."""

    def write(self, name: str, chunks: Iterable[bytes | memoryview], checksum: bool) -> tuple[int, int]:
        """Write ``chunks`` as ``name``; returns (size, CRC-32C) (0 without ``checksum``)."""
        ...

    def start_sync(self, others: Iterable[str] = ()) -> PendingSync:
        """fsync the files written so far and ``others`` concurrently; ``wait()`` on the result."""
        ...

    def sync(self, others: Iterable[str] = ()) -> None:
        """fsync the files written so far and ``others`` on this thread."""
        ...

    def close(self) -> None:
        """Close the kept descriptors."""
        ...
