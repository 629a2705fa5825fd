"""Snapshot buffers in shared memory, for a writer process (engine.checkpoint.writers.process.writer).

Each slot is one file in a directory of its own under ``/dev/shm`` (or the system's temporary
directory where there is none), mapped by both processes: the training process lays the
state's tensors out in it once per structure (engine.checkpoint.writers.buffers.SnapshotBuffers) and
copies them in bulk at every snapshot; the writer process maps the same file and writes its
bytes as ``tensors.bin``. A structure change (a new optimizer state entry, a lazily created
buffer, a shape or dtype change) lays the slot out again in a *new* file (the writer drops its
mapping of the old one when it first sees the new name), so a mapping never changes size under
a reader. No Python object crosses the process boundary: only the file's name.

After the tensors' bytes, each slot holds its *generation*: the id of the snapshot it holds,
written last, under an ``flock`` of the slot's file. The writer process takes a slot up under
the same lock and commits it only if the generation is the one its message names: with
``when_behind="skip"`` the training process may take back a slot the writer has not taken up
yet (the lock is free) and put a newer snapshot there; the writer then finds another generation
and reports the old snapshot superseded. A reader never sees a torn snapshot.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import mmap
import os
import shutil
import struct
import tempfile
from typing import TYPE_CHECKING

from engine.checkpoint.store.file_lock import try_lock
from engine.checkpoint.store.lease import close_in_forked_children
from engine.checkpoint.writers.buffers import SnapshotBuffers

if TYPE_CHECKING:
    import torch

SHARED_MEMORY_ROOT = "/dev/shm"
ARENA_PREFIX = "splitloop-snapshots-"
# In each arena directory, a file whose flock every process using the arena holds (shared): the
# training process, and its writer process through the descriptor it inherits. The kernel drops
# it with the last of them, however they died: an arena is orphaned when nobody holds it, which
# no PID (reused in containers) could tell.
OWNERS_FILE = "owners.lock"
# Owner descriptors: a forked child (a DataLoader worker) must not hold an arena alive.
_OWNER_DESCRIPTORS: set[int] = set()
close_in_forked_children(_OWNER_DESCRIPTORS)


@dataclasses.dataclass
class ArenaDirectory:
    """One run's directory of slot files, and the descriptor by which this process holds it
    (pass it to the writer process: it then holds the arena too)."""

    path: str
    owner_descriptor: int

    def remove(self) -> None:
        """Delete the slot files and let go of the arena (once; again does nothing)."""
        if self.owner_descriptor < 0:
            return
        remove_arena_directory(self.path)
        _OWNER_DESCRIPTORS.discard(self.owner_descriptor)
        os.close(self.owner_descriptor)
        self.owner_descriptor = -1


def arena_root() -> str:
    """Where arena directories are made: in memory where the system has it."""
    usable = os.path.isdir(SHARED_MEMORY_ROOT) and os.access(SHARED_MEMORY_ROOT, os.W_OK)
    return SHARED_MEMORY_ROOT if usable else tempfile.gettempdir()


def make_arena_directory(root: str | None = None) -> ArenaDirectory:
    """A new private directory for one run's slot files, held by this process (OWNERS_FILE)
    before it takes the name :func:`remove_orphaned_arena_directories` looks at."""
    staging = tempfile.mkdtemp(prefix=f".{ARENA_PREFIX}{os.getpid()}-", dir=root or arena_root())
    descriptor = os.open(os.path.join(staging, OWNERS_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(descriptor, fcntl.LOCK_SH)
    _OWNER_DESCRIPTORS.add(descriptor)
    path = os.path.join(os.path.dirname(staging), os.path.basename(staging)[1:])
    os.rename(staging, path)
    return ArenaDirectory(path, descriptor)


def remove_orphaned_arena_directories(root: str | None = None) -> list[str]:
    """Delete the arena directories under ``root`` (:func:`arena_root` by default) that no live
    process holds: those of a training process and a writer process both killed (SIGKILL, OOM),
    which nothing else would remove from memory. Returns the paths removed."""
    root = root or arena_root()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    candidates = [os.path.join(root, name) for name in sorted(names) if name.startswith(ARENA_PREFIX)]
    return [path for path in candidates if _remove_if_orphaned(path)]


def _remove_if_orphaned(directory: str) -> bool:
    """Remove ``directory`` if nobody holds its OWNERS_FILE (taken exclusively meanwhile, so no
    one can take it up); keep one without that file (another user's, or another version's)."""
    descriptor = try_lock(os.path.join(directory, OWNERS_FILE), os.O_RDONLY | os.O_CLOEXEC, fcntl.LOCK_EX)
    if descriptor is None:  # a live process holds it, or it has none
        return False
    try:
        shutil.rmtree(directory, ignore_errors=True)
    finally:
        os.close(descriptor)
    return True


def remove_arena_directory(directory: str) -> None:
    """Delete a run's slot files (either process may, whichever ends last)."""
    shutil.rmtree(directory, ignore_errors=True)


_GENERATION_BYTES = 64  # an int64, padded to the alignment of the tensors
_GENERATION = struct.Struct("<q")


def generation_offset(tensor_bytes: int) -> int:
    """Where a slot's generation lies, after ``tensor_bytes`` bytes of tensors."""
    return (tensor_bytes + _GENERATION_BYTES - 1) // _GENERATION_BYTES * _GENERATION_BYTES


def _reserve(descriptor: int, size: int, path: str) -> None:
    """Allocate a new slot file's ``size`` bytes now. A page of a sparse file in a full tmpfs
    (a container's 64 MB ``/dev/shm``) is allocated when the copy first touches it, and then
    the kernel kills the training process with SIGBUS; allocated here, a lack of room is an
    OSError (ENOSPC) that fails this checkpoint like a full disk (``on_io_error``)."""
    allocate = getattr(os, "posix_fallocate", None)  # not on macOS (its /tmp is a disk anyway)
    if allocate is None:
        return
    try:
        allocate(descriptor, 0, size)
    except OSError as error:
        if error.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # a filesystem that cannot reserve (as before: pages come on first touch)
        root = os.path.dirname(os.path.dirname(path))
        raise OSError(error.errno, (
            f"no room in {root} for a snapshot slot of the writer process ({size} bytes, {_free_bytes(root)} "
            "free; a run has max_in_flight slots, two more with when_behind='skip'): make it larger "
            "(docker run --shm-size=...) or use CheckpointConfig(writer='thread') "
            f"({error.strerror})")) from error


def _free_bytes(directory: str) -> str:
    try:
        status = os.statvfs(directory)
    except OSError:
        return "unknown"
    return str(status.f_bavail * status.f_frsize)


class SlotFile:
    """One slot file mapped shared: its bytes, its generation, and the lock that guards both."""

    def __init__(self, path: str, tensor_bytes: int, create: bool) -> None:
        self.path = path
        self.tensor_bytes = tensor_bytes
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        self._descriptor = os.open(path, flags, 0o600)
        self._generation_offset = generation_offset(tensor_bytes)
        size = self._generation_offset + _GENERATION_BYTES
        if create:
            try:
                os.ftruncate(self._descriptor, size)
                _reserve(self._descriptor, size, path)
            except BaseException:
                os.close(self._descriptor)
                os.unlink(path)
                raise
        self._mapping = mmap.mmap(self._descriptor, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # The tensors' bytes as the writer process writes them (it has no torch to view them with).
        self.flat = memoryview(self._mapping)[:tensor_bytes]

    def lock(self, wait: bool = True) -> bool:
        """Take the slot's lock; False when ``wait`` is off and the other process holds it."""
        try:
            fcntl.flock(self._descriptor, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        return True

    def unlock(self) -> None:
        fcntl.flock(self._descriptor, fcntl.LOCK_UN)

    @property
    def generation(self) -> int:
        return int(_GENERATION.unpack_from(self._mapping, self._generation_offset)[0])

    @generation.setter
    def generation(self, value: int) -> None:
        _GENERATION.pack_into(self._mapping, self._generation_offset, value)

    def close(self) -> None:
        """Unmap once no tensor of this process uses the bytes any more (the caller's word)."""
        os.close(self._descriptor)


class SharedSnapshotBuffers(SnapshotBuffers):
    """:class:`SnapshotBuffers` whose one flat buffer is a file of ``directory`` mapped shared
    (slot ``index``); :attr:`path` names the file of the current layout."""

    def __init__(self, directory: str, index: int) -> None:
        super().__init__()
        self._directory = directory
        self._index = index
        self._layouts = 0
        self.file: SlotFile | None = None

    @property
    def path(self) -> str:
        return "" if self.file is None else self.file.path

    def lock(self, wait: bool = True) -> bool:
        """Take the slot's lock (see the module docstring): before a new snapshot is copied in."""
        assert self.file is not None or wait
        return True if self.file is None else self.file.lock(wait)

    def publish(self, generation: int) -> None:
        """Write the generation of the snapshot just copied in (last), and unlock. Nothing to
        do before a first file exists (its allocation failed)."""
        if self.file is None:
            return
        self.file.generation = generation
        self.file.unlock()

    def _allocate(self, tensors: list[torch.Tensor], layout: list[tuple[int, int]], pinned: bool) -> None:
        import torch  # the training process's side: the writer process imports this module without torch

        total = layout[-1][0] + layout[-1][1] if layout else 0
        self._flat = None
        self._views = []
        old = self.file
        self._layouts += 1
        self.file = SlotFile(os.path.join(self._directory, f"slot-{self._index}-{self._layouts}"), total, create=True)
        self.file.lock()  # held until publish(), like the old file's (released with it)
        # (torch.frombuffer refuses an empty buffer: a state without tensor bytes)
        flat = torch.frombuffer(self.file.flat, dtype=torch.uint8) if total else torch.zeros(0, dtype=torch.uint8)
        self._views = [flat[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
                       for tensor, (offset, nbytes) in zip(tensors, layout)]
        self._flat = flat
        if old is not None:
            os.unlink(old.path)  # a writer that still maps it keeps its pages until it lets go
            old.close()
