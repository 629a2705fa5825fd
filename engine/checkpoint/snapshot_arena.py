"""Snapshot buffers in shared memory, for a writer process (engine.checkpoint.writer_process).

Each slot is one file in a directory of its own under ``/dev/shm`` (or the system's temporary
directory where there is none), mapped by both processes: the training process lays the
state's tensors out in it once per structure (engine.checkpoint.writer.SnapshotBuffers) and
copies them in bulk at every snapshot; the writer process maps the same file and writes its
bytes as ``tensors.bin``. A structure change (a new optimizer state entry, a lazily created
buffer, a shape or dtype change) lays the slot out again in a *new* file (the writer drops its
mapping of the old one when it first sees the new name), so a mapping never changes size under
a reader. No Python object crosses the process boundary: only the file's name.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile

import torch

from engine.checkpoint.writer import SnapshotBuffers

SHARED_MEMORY_ROOT = "/dev/shm"


def make_arena_directory() -> str:
    """A new private directory for one run's slot files (in memory where the system has it)."""
    root = SHARED_MEMORY_ROOT if os.path.isdir(SHARED_MEMORY_ROOT) and os.access(SHARED_MEMORY_ROOT, os.W_OK) else None
    return tempfile.mkdtemp(prefix=f"splitloop-snapshots-{os.getpid()}-", dir=root)


def remove_arena_directory(directory: str) -> None:
    """Delete a run's slot files (either process may, whichever ends last)."""
    shutil.rmtree(directory, ignore_errors=True)


def map_file(path: str, size: int) -> tuple[mmap.mmap | None, torch.Tensor]:
    """Map ``size`` bytes of ``path`` shared; the mapping and a uint8 tensor over it (an empty
    tensor and no mapping for 0 bytes: mmap refuses empty files)."""
    if size == 0:
        return None, torch.zeros(0, dtype=torch.uint8)
    descriptor = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        mapping = mmap.mmap(descriptor, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(descriptor)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8, count=size)


class SharedSnapshotBuffers(SnapshotBuffers):
    """:class:`SnapshotBuffers` whose one flat buffer is a file of ``directory`` mapped shared
    (slot ``index``); :attr:`path` names the file of the current layout."""

    def __init__(self, directory: str, index: int) -> None:
        super().__init__()
        self._directory = directory
        self._index = index
        self._layouts = 0
        self.path = ""
        self._mapping: mmap.mmap | None = None

    def _allocate(self, tensors: list[torch.Tensor], layout: list[tuple[int, int]], pinned: bool) -> None:
        total = layout[-1][0] + layout[-1][1] if layout else 0
        self._flat = None
        self._views = []
        old_path = self.path
        self._layouts += 1
        self.path = os.path.join(self._directory, f"slot-{self._index}-{self._layouts}")
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(descriptor, total)
        finally:
            os.close(descriptor)
        self._mapping, flat = map_file(self.path, total)
        self._views = [flat[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
                       for tensor, (offset, nbytes) in zip(tensors, layout)]
        self._flat = flat
        if old_path:
            os.unlink(old_path)  # a writer that still maps it keeps its pages until it lets go
