"""A run directory on any fsspec filesystem, behind a small protocol with string paths.

Local paths (``/abs``, ``relative``, ``file://...``) get real durability: files are fsynced
and renames are atomic on one filesystem. Other filesystems (``memory://``, object stores)
have no atomic rename, which the checkpoint commit protocol accounts for.

``s3://bucket/prefix`` run directories go through ``s3fs`` (``pip install 'splitloop[s3]'``),
configured from the standard AWS environment (see docs/object-stores.md). There a file can be
created only if absent (a conditional ``PutObject``/``CompleteMultipartUpload`` with
``If-None-Match: *``): :meth:`Storage.write` with ``exclusive=True``; and an object can be
replaced only if it is still the version read (``If-Match: <ETag>``): :meth:`Storage.version`
then :meth:`Storage.replace_prefix_if_unchanged`.
"""

from __future__ import annotations

import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

import fsspec
from fsspec.implementations.local import LocalFileSystem

from engine.checkpoint import checksum as checksums
from engine.errors import ConfigError

_OBJECT_STORE_PROTOCOLS = ("s3", "s3a")
# S3's bounds on a multipart upload's parts: every part but the last at least 5 MiB; a part
# copied from an object at most 5 GiB.
_MIN_COPIED_PART = 5 * 2**20
_MAX_COPIED_PART = 5 * 2**30
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


def open_filesystem(url: str, field: str = "run_dir") -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of ``url`` and the path inside it. ``s3://`` URLs get an s3fs
    filesystem without a listings cache (other processes write the same run directory, and a
    cached listing would hide their checkpoints), its endpoint read from ``AWS_ENDPOINT_URL_S3``
    or ``AWS_ENDPOINT_URL`` when set. Raises ConfigError when s3fs is missing."""
    protocol = url.split("://", 1)[0].lower() if "://" in url else ""
    if protocol not in _OBJECT_STORE_PROTOCOLS:
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


def check_name(name: str, what: str = "name") -> str:
    """Refuse anything but a plain file name (no separators, no '..', no hidden names)."""
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name) or ".." in name:
        raise ConfigError(f"{what}: {name!r} is not a plain file name (letters, digits, '.', '_', '-')")
    return name


class Storage:
    """Files under one root directory, addressed by relative '/'-separated names."""

    def __init__(self, url: str, filesystem: fsspec.AbstractFileSystem | None = None, create: bool = True) -> None:
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
        if filesystem is None:
            filesystem, root = open_filesystem(url)
        else:
            root = filesystem._strip_protocol(url)
        self.url = url
        self.fs = filesystem
        self.root = root.rstrip("/") or "/"
        # A wrapping filesystem (engine.faults.faulty_fs) keeps the protocol of what it wraps; the
        # local fast paths below then ask it before each write so its faults still fire.
        inner = getattr(filesystem, "inner", filesystem)
        # A local filesystem: plain files (fsync, flock, O_NOFOLLOW fast paths).
        self.is_local = isinstance(inner, LocalFileSystem)
        # Not wrapped either (engine.faults.faulty_fs): reads may go straight to the OS.
        self._plain_local = isinstance(filesystem, LocalFileSystem)
        # Where a rename is atomic, it is a checkpoint's commit point; elsewhere (object stores)
        # the manifest, written last, is. Today exactly the local filesystems.
        self.rename_is_atomic = self.is_local
        # Object stores that refuse to create an object that exists (If-None-Match: *).
        protocols = inner.protocol if isinstance(inner.protocol, (tuple, list)) else (inner.protocol,)
        self.exclusive_create = any(protocol in _OBJECT_STORE_PROTOCOLS for protocol in protocols)
        self._before_write = getattr(filesystem, "before_write", None) if self.is_local else None
        self._sync_pool: ThreadPoolExecutor | None = None
        self._real_paths: dict[str, str] = {}
        if create:
            self.fs.makedirs(self.root, exist_ok=True)
        elif not self.fs.isdir(self.root):
            raise ConfigError(f"run directory {url!r} does not exist")

    def path(self, relative: str) -> str:
        if relative == "":
            return self.root
        parts = relative.split("/")
        for part in parts:
            check_name(part, "path component")
        return "/".join([self.root, *parts])

    def _check_write(self) -> None:
        if self._before_write is not None:
            self._before_write()

    def writable_path(self, relative: str) -> str:
        """The path of ``relative`` for a write-type call. On a local disk, refuse a path
        that a symbolic link leads out of the run directory (a symlinked metrics.jsonl or
        checkpoints/ would make the engine truncate and write someone else's file)."""
        path = self.path(relative)
        if self.is_local:
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

    def _open_to_read(self, relative: str) -> tuple[int, int]:
        """A descriptor and the size of the local regular file ``relative``, opened without blocking (a FIFO
        planted in the run directory must not hang the reader). Raises UnreadableFile for a
        path that a link leads out of the run directory and for anything but a regular file (a
        FIFO, a device such as /dev/zero, a socket, a directory)."""
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

    def makedirs(self, relative: str) -> None:
        self.fs.makedirs(self.writable_path(relative), exist_ok=True)

    def write(self, relative: str, chunks: Iterable[bytes | memoryview], durable: bool,
              checksum: bool = True, exclusive: bool = False) -> tuple[int, int]:
        """Write ``chunks`` to a new file; returns (size, CRC-32C) (0 when ``checksum`` is
        False). ``durable`` fsyncs local files. ``exclusive`` creates the file only if it does
        not exist, atomically, and raises FileExistsError otherwise (and leaves the existing
        file alone); only where :attr:`exclusive_create` is true (on S3 a multipart upload
        checks the condition when it completes)."""
        size = 0
        crc = 0
        update = checksums.updater()
        path = self.writable_path(relative)
        self._check_write()
        if exclusive and not self.exclusive_create:
            raise ValueError(f"{self.url}: this filesystem cannot create a file only if absent")
        opener = open if self.is_local else self.fs.open
        with opener(path, "xb" if exclusive else "wb") as handle:
            for chunk in chunks:
                handle.write(chunk)
                if checksum:
                    crc = update(chunk, crc)
                size += len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
            if durable and self.is_local:
                handle.flush()
                os.fsync(handle.fileno())
        return size, crc

    def append(self, relative: str, data: bytes) -> None:
        """Append to a file (durability is the caller's: see :meth:`sync`)."""
        path = self.writable_path(relative)
        self._check_write()
        if self.is_local:
            with open(path, "ab") as handle:
                handle.write(data)
        else:
            with self.fs.open(path, "ab") as handle:
                handle.write(data)

    def read_into(self, relative: str, size: int) -> bytearray:
        """Read a file expected to hold ``size`` bytes into a new bytearray (no extra copy);
        the result is shorter or the read stops early when the file is not that size."""
        if not self.is_local:
            return bytearray(self.fs.cat_file(self.path(relative), start=0, end=size + 1))
        return self._read_local(relative, size + 1)  # one spare byte reveals a longer file

    def _read_local(self, relative: str, limit: int) -> bytearray:
        """At most ``limit`` bytes of the local regular file ``relative`` (see _open_to_read)."""
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

    def replace(self, relative: str, data: bytes) -> None:
        """Replace a small file whole: write a temporary sibling, then rename over the target
        (atomic on a local filesystem)."""
        temporary = f"{relative}.{os.getpid()}.tmp"
        target = self.writable_path(relative)
        try:
            self.write(temporary, [data], durable=True)
            self._check_write()
            if self.is_local:
                os.replace(self.path(temporary), target)
            else:
                self.fs.mv(self.path(temporary), target)
        except BaseException:
            # ENOSPC half-way must not leave the temporary behind (it would outlive the run).
            try:
                self.remove_file(temporary)
            except OSError:
                pass
            raise

    def read(self, relative: str, limit: int | None = None) -> bytes:
        """The content of a file, at most its first ``limit`` bytes when a limit is given (the
        caller refuses a longer file as too large to be what it expects). On a local disk, only
        a regular file inside the run directory is read (UnreadableFile otherwise, see
        :meth:`_open_to_read`)."""
        path = self.path(relative)
        if self.is_local:
            if limit is not None:
                return bytes(self._read_local(relative, limit))
            with open(self._open_to_read(relative)[0], "rb") as handle:
                return handle.read()
        # A ranged read on an object store: a huge object is not downloaded whole.
        return self.fs.cat_file(path) if limit is None else self.fs.cat_file(path, start=0, end=limit)

    def size(self, relative: str) -> int:
        if self._plain_local:
            return os.stat(self.path(relative)).st_size
        return int(self.fs.size(self.path(relative)))

    def exists(self, relative: str) -> bool:
        if self._plain_local:
            return os.path.lexists(self.path(relative))
        return bool(self.fs.exists(self.path(relative)))

    def truncate(self, relative: str, size: int) -> None:
        """Cut a file to its first ``size`` bytes."""
        path = self.writable_path(relative)
        self._check_write()
        if self.is_local:
            os.truncate(path, size)
            return
        head = self.fs.cat_file(path)[:size]
        with self.fs.open(path, "wb") as handle:
            handle.write(head)

    def list_names(self, relative: str) -> list[str]:
        """Names directly under a directory (empty if it does not exist)."""
        path = self.path(relative)
        if self._plain_local:  # the listing of every commit and retention: no fsspec layers
            try:
                return os.listdir(path)
            except FileNotFoundError:
                return []
            except NotADirectoryError:
                pass  # as fsspec has it: the file itself
        if not self.fs.exists(path):
            return []
        names = []
        for entry in self.fs.ls(path, detail=False):
            names.append(entry.rstrip("/").rsplit("/", 1)[-1])
        return names

    def remove_tree(self, relative: str) -> None:
        path = self.writable_path(relative)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def remove_file(self, relative: str) -> None:
        path = self.writable_path(relative)
        if self.fs.exists(path):
            self.fs.rm_file(path)

    def abort_unfinished_uploads(self, relative: str) -> int:
        """Abort the multipart uploads under ``relative`` that never completed (S3 only: a
        process killed while it uploaded a large file leaves its parts stored, invisible and
        billed). Call only while no other live process writes there. Returns how many."""
        if not self.exclusive_create:
            return 0
        s3: Any = getattr(self.fs, "inner", self.fs)
        bucket, key, _ = s3.split_path(self.writable_path(relative))
        aborted = 0
        while True:  # each round lists what the previous one left (a listing holds 1000 at most)
            listing = s3.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key.rstrip("/") + "/")
            for upload in listing.get("Uploads", []):
                s3.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted += 1
            if not listing.get("IsTruncated") or not listing.get("Uploads"):
                return aborted

    def version(self, relative: str) -> tuple[int, str | None]:
        """An object's size and version (its ETag); ``(0, None)`` when it does not exist. Only
        where :attr:`exclusive_create` is true; see :meth:`replace_prefix_if_unchanged`."""
        s3, bucket, key = self._s3_object(relative)
        try:
            head = s3.call_s3("head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return 0, None
        return int(head["ContentLength"]), str(head["ETag"])

    def replace_prefix_if_unchanged(self, relative: str, keep: int, data: bytes, version: str | None) -> bool:
        """Replace an object with its first ``keep`` bytes followed by ``data``, only if it is
        still ``version`` (from :meth:`version`; None: only if it does not exist). A small
        object is read and put back whole in one ``PutObject``; from 5 MiB the kept bytes are
        copied server-side into a multipart upload. Either way the write that makes the new
        object visible is conditional (``If-Match`` / ``If-None-Match``). False when another
        writer changed the object since ``version`` was read, and nothing was changed."""
        s3, bucket, key = self._s3_object(relative)
        self._check_write()
        try:
            if keep >= _MIN_COPIED_PART:
                assert version is not None  # the kept bytes are in the object
                self._put_in_parts(s3, bucket, key, keep, data, version)
            else:
                head = s3.cat_file(self.path(relative), start=0, end=keep) if keep else b""
                condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
                s3.call_s3("put_object", Bucket=bucket, Key=key, Body=head + data, **condition)
        except FileExistsError:  # s3fs's name for a failed If-None-Match
            return False
        except OSError as error:
            if _is_failed_precondition(error):
                return False
            raise
        finally:
            s3.invalidate_cache(self.path(relative))
        return True

    def _s3_object(self, relative: str) -> tuple[Any, str, str]:
        s3: Any = getattr(self.fs, "inner", self.fs)
        bucket, key, _ = s3.split_path(self.writable_path(relative))
        return s3, bucket, key

    @staticmethod
    def _put_in_parts(s3: Any, bucket: str, key: str, keep: int, data: bytes, version: str) -> None:
        """The kept bytes copied server-side (a part of at most 5 GiB, as S3 allows), ``data``
        uploaded as the last part; the copy and the completion are conditional on ``version``."""
        if keep > _MAX_COPIED_PART:
            raise OSError(f"s3://{bucket}/{key} is {keep} bytes long; an object beyond 5 GiB is not appended to")
        upload = s3.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        try:
            copied = s3.call_s3("upload_part_copy", Bucket=bucket, Key=key, UploadId=upload, PartNumber=1,
                                CopySource={"Bucket": bucket, "Key": key}, CopySourceRange=f"bytes=0-{keep - 1}",
                                CopySourceIfMatch=version)
            parts = [{"PartNumber": 1, "ETag": copied["CopyPartResult"]["ETag"]}]
            if data:
                uploaded = s3.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=2, Body=data)
                parts.append({"PartNumber": 2, "ETag": uploaded["ETag"]})
            s3.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
                       MultipartUpload={"Parts": parts}, IfMatch=version)
        except BaseException:
            s3.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
            raise

    def rename(self, source: str, target: str) -> None:
        """Atomic on a local filesystem (one ``os.rename``); a copy elsewhere."""
        source_path, target_path = self.writable_path(source), self.writable_path(target)
        self._check_write()
        if self.is_local:
            os.rename(source_path, target_path)
        else:
            self.fs.mv(source_path, target_path, recursive=True)

    def sync(self, relatives: Iterable[str]) -> None:
        """fsync files and directories (local filesystems only), concurrently: the kernel
        batches concurrent fsyncs into fewer journal commits, which halves the wait."""
        self.start_sync(relatives).wait()

    def start_sync(self, relatives: Iterable[str]) -> "PendingSync":
        """Like :meth:`sync`, but returns at once; ``wait()`` on the result."""
        if not self.is_local:
            return PendingSync([])
        self._check_write()
        paths = [self.path(relative) if relative else self.root for relative in relatives]
        pool = self._fsync_pool()
        return PendingSync([pool.submit(_fsync_path, path) for path in paths])

    def _fsync_pool(self) -> ThreadPoolExecutor:
        if self._sync_pool is None:
            self._sync_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="splitloop-fsync")
        return self._sync_pool

    def local_files(self, directory: str) -> "LocalDirectoryFiles":
        """Write a checkpoint's files into the local ``directory`` through kept descriptors
        (local filesystems only); see :class:`LocalDirectoryFiles`."""
        assert self.is_local, "local fast path on a non-local filesystem"
        return LocalDirectoryFiles(self, directory)

    def fsync_directory(self, relative: str) -> None:
        """Make a rename or a new file in ``relative`` durable (local filesystems only)."""
        if not self.is_local:
            return
        descriptor = os.open(self.path(relative) if relative else self.root, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _is_failed_precondition(error: OSError) -> bool:
    """Whether s3fs's error stands for S3's "412 Precondition Failed" (or "409 Conditional
    Request Conflict": a concurrent conditional write won)."""
    response = getattr(error.__cause__, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return code in ("PreconditionFailed", "ConditionalRequestConflict")


def _fsync_path(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class PendingSync:
    """fsyncs running in background threads (fsync releases the GIL)."""

    def __init__(self, futures: list) -> None:
        self._futures = futures

    def wait(self) -> None:
        """Block until every fsync finished; re-raise the first error."""
        errors = [future.exception() for future in self._futures]
        for error in errors:
            if error is not None:
                raise error


class LocalDirectoryFiles:
    """The files of one new checkpoint in a local staging directory, written through kept
    descriptors (local fast path, see :meth:`Storage.local_files`): no path resolution per
    file, and the fsync reuses the descriptor the write used. Files are opened with
    ``O_NOFOLLOW`` (a symbolic link planted in the directory is refused, not followed) and
    without truncation, so that a recycled directory's files are overwritten in place (no block
    freed and reallocated); each is cut to its new size once written."""

    def __init__(self, storage: Storage, directory: str) -> None:
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

    def start_sync(self, others: Iterable[str] = ()) -> "PendingSync":
        """fsync every file written so far and ``others`` (run-dir-relative paths; "" is the
        run directory) concurrently; ``wait()`` on the result."""
        self._storage._check_write()
        pool = self._storage._fsync_pool()
        futures = [pool.submit(os.fsync, descriptor) for descriptor in self._descriptors]
        paths = [self._storage.path(relative) if relative else self._storage.root for relative in others]
        futures += [pool.submit(_fsync_path, path) for path in paths]
        return PendingSync(futures)

    def sync(self, others: Iterable[str] = ()) -> None:
        """fsync every file written so far and ``others``, one after the other on this thread.
        For small checkpoints: the same wait as concurrent fsyncs here (the kernel's journal
        commit dominates), without waking a thread per file, each of which takes the GIL."""
        self._storage._check_write()
        for descriptor in self._descriptors:
            os.fsync(descriptor)
        for relative in others:
            _fsync_path(self._storage.path(relative) if relative else self._storage.root)

    def close(self) -> None:
        descriptors, self._descriptors = self._descriptors, []
        for descriptor in descriptors:
            os.close(descriptor)
