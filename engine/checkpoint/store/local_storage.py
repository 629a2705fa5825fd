"""The run directory on a local disk: fsynced files, atomic renames, and the protections of a
directory other users may write into (reads only of regular files, opened without blocking and
bounded; no symbolic link leading out of the run directory; O_NOFOLLOW for checkpoint files)."""

from __future__ import annotations

import os
import stat
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Collection, Iterable

from engine.checkpoint.format import checksum as checksums
from engine.checkpoint.format.checksum import write_chunks
from engine.checkpoint.format.names import check_name
from engine.checkpoint.store.storage import LOCAL, PendingSync, Storage, UnreadableFile
from engine.errors import ConfigError


def _no_fault() -> None:
    pass


class LocalStorage(Storage, kind=LOCAL):
    """A :class:`Storage` on a local filesystem (possibly wrapped by engine.faults.faulty_fs:
    then every write first asks the wrapper, so its faults still fire)."""

    is_local = True
    rename_is_atomic = True

    def _setup(self) -> None:
        self._check_write: Callable[[], None] = getattr(self.fs, "before_write", _no_fault)
        self._sync_pool: ThreadPoolExecutor | None = None
        self._real_paths: dict[str, str] = {}

    # -- paths inside the run directory ---------------------------------------------------
    def writable_path(self, relative: str) -> str:
        """The path of ``relative`` for a write-type call. Refuses a path that a symbolic link
        leads out of the run directory (a symlinked metrics.jsonl or checkpoints/ would make the
        engine truncate and write someone else's file)."""
        path = self.path(relative)
        real = self._outside_target(relative, path)
        if real is not None:
            raise ConfigError(
                f"{path} leads to {real}, outside the run directory {self._real_path('')} (a "
                "symbolic link); the engine writes only inside its run directory. Replace the "
                "link with a plain file or directory"
            )
        return path

    def _outside_target(self, relative: str, path: str) -> str | None:
        """Where ``path`` really leads when a symbolic link takes it out of the run directory;
        None when it stays inside."""
        real_root = self._real_path("")
        real = self._resolve(relative, path)
        if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
            return real
        return None

    def _real_path(self, relative: str) -> str:
        """``os.path.realpath`` of the run directory or one of its top-level entries, resolved
        once per Storage (they are the engine's own directories: checkpoints/ and the like)."""
        real = self._real_paths.get(relative)
        if real is None:
            real = os.path.realpath(self.path(relative))
            if os.path.isdir(real):  # a missing entry may still be created as a link: not cached
                self._real_paths[relative] = real
        return real

    def _resolve(self, relative: str, path: str) -> str:
        """Where ``path`` really leads: its top-level entry's cached real path, then one
        ``lstat`` per deeper component (a full ``realpath`` as soon as one is a link). Per
        checkpoint this runs for every file and directory written: it must stay cheap."""
        if not relative:
            return self._real_path("")
        top, _, rest = relative.partition("/")
        real = self._real_path(top)
        if not rest:
            return real
        parts = rest.split("/")
        for index, part in enumerate(parts):
            real = f"{real}/{part}"
            try:
                if stat.S_ISLNK(os.lstat(real).st_mode):
                    return os.path.realpath(path)
            except FileNotFoundError:  # what does not exist yet is no link
                return "/".join([real, *parts[index + 1:]])
        return real

    # -- reads ----------------------------------------------------------------------------
    def _open_to_read(self, relative: str) -> tuple[int, int]:
        """A descriptor and the size of the regular file ``relative``, opened without blocking
        (a FIFO planted in the run directory must not hang the reader). Raises UnreadableFile
        for a path that a link leads out of the run directory and for anything but a regular
        file (a FIFO, a device such as /dev/zero, a socket, a directory)."""
        path = self.path(relative)
        outside = self._outside_target(relative, path)
        if outside is not None:
            raise UnreadableFile(f"{path} leads to {outside}, outside the run directory (a symbolic link); "
                                 "the engine reads only inside its run directory")
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            status = os.fstat(descriptor)
            mode = status.st_mode
            if not stat.S_ISREG(mode):
                kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, device or socket)"
                raise UnreadableFile(f"{path} is {kind}; expected a file the engine wrote")
        except BaseException:
            os.close(descriptor)
            raise
        return descriptor, status.st_size

    def _read_bounded(self, relative: str, limit: int) -> bytearray:
        """At most ``limit`` bytes of the regular file ``relative`` (see _open_to_read)."""
        descriptor, size = self._open_to_read(relative)
        # Sized by the file, not by the limit: a small file costs a small buffer.
        buffer = bytearray(min(limit, size + 1))
        view = memoryview(buffer)
        filled = 0
        with open(descriptor, "rb", buffering=0) as handle:
            while filled < len(buffer):
                count = handle.readinto(view[filled:])
                if not count:
                    break
                filled += count
        del view
        del buffer[filled:]
        return buffer

    def read_into(self, relative: str, size: int) -> bytearray:
        return self._read_bounded(relative, size + 1)  # one spare byte reveals a longer file

    def read(self, relative: str, limit: int | None = None) -> bytes:
        """See :meth:`Storage.read`; only a regular file inside the run directory is read
        (UnreadableFile otherwise, see :meth:`_open_to_read`)."""
        if limit is not None:
            return bytes(self._read_bounded(relative, limit))
        with open(self._open_to_read(relative)[0], "rb") as handle:
            return handle.read()

    def size(self, relative: str) -> int:
        return os.stat(self.path(relative)).st_size

    def exists(self, relative: str) -> bool:
        return os.path.lexists(self.path(relative))

    def list_names(self, relative: str) -> list[str]:
        path = self.path(relative)
        try:  # the listing of every commit and retention: no fsspec layers
            return os.listdir(path)
        except FileNotFoundError:
            return []
        except NotADirectoryError:  # as fsspec has it: the file itself
            return [path.rsplit("/", 1)[-1]]

    # -- writes ---------------------------------------------------------------------------
    def write(self, relative: str, chunks: Iterable[bytes | memoryview], durable: bool,
              checksum: bool = True, exclusive: bool = False) -> tuple[int, int]:
        path = self.writable_path(relative)
        self._check_write()
        self._refuse_exclusive(exclusive)
        with open(path, "wb") as handle:
            size, crc = write_chunks(handle, chunks, checksum)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        return size, crc

    def append(self, relative: str, data: bytes) -> None:
        path = self.writable_path(relative)
        self._check_write()
        with open(path, "ab") as handle:
            handle.write(data)

    def truncate(self, relative: str, size: int) -> None:
        path = self.writable_path(relative)
        self._check_write()
        os.truncate(path, size)

    def rename(self, source: str, target: str) -> None:
        source_path, target_path = self.writable_path(source), self.writable_path(target)
        self._check_write()
        os.rename(source_path, target_path)

    def reuse_directory(self, source: str, target: str, allowed_files: Collection[str]) -> bool:
        try:
            with os.scandir(self.path(source)) as entries:
                if not all(entry.name in allowed_files and entry.is_file(follow_symlinks=False) for entry in entries):
                    return False
        except OSError:
            return False
        self.rename(source, target)
        return True

    def _move_over(self, source: str, target_path: str) -> None:
        self._check_write()
        os.replace(self.path(source), target_path)

    # -- durability -----------------------------------------------------------------------
    def start_sync(self, relatives: Iterable[str]) -> PendingSync:
        self._check_write()
        paths = [self.path(relative) if relative else self.root for relative in relatives]
        pool = self.fsync_pool()
        return PendingSync([pool.submit(fsync_path, path) for path in paths])

    def fsync_pool(self) -> ThreadPoolExecutor:
        """The threads that run this directory's concurrent fsyncs (made on first use)."""
        if self._sync_pool is None:
            self._sync_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="splitloop-fsync")
        return self._sync_pool

    def fsync_directory(self, relative: str) -> None:
        fsync_path(self.path(relative) if relative else self.root)

    def local_files(self, directory: str) -> LocalDirectoryFiles:
        return LocalDirectoryFiles(self, directory)


def fsync_path(path: str) -> None:
    """fsync a file or directory by path."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class LocalDirectoryFiles:
    """The files of one new checkpoint in a local staging directory, written through kept
    descriptors (local fast path, see :meth:`Storage.local_files`): no path resolution per
    file, and the fsync reuses the descriptor the write used. Files are opened with
    ``O_NOFOLLOW`` (a symbolic link planted in the directory is refused, not followed) and
    without truncation, so that a recycled directory's files are overwritten in place (no block
    freed and reallocated); each is cut to its new size once written."""

    def __init__(self, storage: LocalStorage, directory: str) -> None:
        self._storage = storage
        self._directory = storage.writable_path(directory)
        self._descriptors: list[int] = []

    def write(self, name: str, chunks: Iterable[bytes | memoryview], checksum: bool) -> tuple[int, int]:
        """Write ``chunks`` as ``name``; returns (size, CRC-32C) (0 without ``checksum``)."""
        check_name(name, "file name")
        self._storage._check_write()
        descriptor = os.open(f"{self._directory}/{name}",
                             os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        self._descriptors.append(descriptor)
        size = 0
        crc = 0
        update = checksums.updater()
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            size += view.nbytes
            if checksum:
                crc = update(view, crc)
            while view:
                written = os.write(descriptor, view)
                view = view[written:]
        if os.fstat(descriptor).st_size != size:
            os.ftruncate(descriptor, size)
        return size, crc

    def start_sync(self, others: Iterable[str] = ()) -> PendingSync:
        """fsync every file written so far and ``others`` (run-dir-relative paths; "" is the
        run directory) concurrently; ``wait()`` on the result."""
        self._storage._check_write()
        pool = self._storage.fsync_pool()
        futures: list[Future[None]] = [pool.submit(os.fsync, descriptor) for descriptor in self._descriptors]
        paths = [self._storage.path(relative) if relative else self._storage.root for relative in others]
        futures += [pool.submit(fsync_path, path) for path in paths]
        return PendingSync(futures)

    def sync(self, others: Iterable[str] = ()) -> None:
        """fsync every file written so far and ``others``, one after the other on this thread.
        For small checkpoints: the same wait as concurrent fsyncs here (the kernel's journal
        commit dominates), without waking a thread per file, each of which takes the GIL."""
        self._storage._check_write()
        for descriptor in self._descriptors:
            os.fsync(descriptor)
        for relative in others:
            fsync_path(self._storage.path(relative) if relative else self._storage.root)

    def close(self) -> None:
        """Close the kept descriptors."""
        descriptors, self._descriptors = self._descriptors, []
        for descriptor in descriptors:
            os.close(descriptor)
