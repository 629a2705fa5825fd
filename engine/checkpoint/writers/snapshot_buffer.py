"""The copy of a snapshot's tensors into their views of one flat buffer, as few bulk copies.

A snapshot buffer (engine.checkpoint.writers.buffers.SnapshotBuffers) is laid out once per structure;
every later snapshot copies the same tensors into the same views. Copying them one ``copy_`` at
a time costs a Python call and a dispatch per tensor (tens of tensors for a small model:
more than the bytes themselves); ``torch._foreach_copy_`` copies a whole list in one call.
Tensors are grouped by where they come from, so that device-to-host copies stay non-blocking
and host copies stay synchronous.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

# Host copies of fewer bytes than this run on one intra-op thread: with torch's default thread
# count the copy of a 1.1 MB state cost the training thread ten times its single-threaded CPU
# time (waking, and spin-waiting for, OpenMP workers on busy cores); larger states keep the
# threads, whose memory bandwidth they can use.
SINGLE_THREAD_COPY_BYTES = 16 << 20


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Run the block with ``torch.get_num_threads() == 1``; the count is restored after."""
    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)

StructureKey = tuple[tuple[torch.dtype, ...], tuple[torch.Size, ...], tuple[bool, ...]]


def structure_key(tensors: Sequence[torch.Tensor]) -> StructureKey:
    """What the buffer's layout depends on: each tensor's dtype and shape, and whether it lives
    on a CUDA device (then copied into pinned memory). A change (a new optimizer state entry, a
    lazily created buffer, a dtype or shape change) means laying the buffer out again."""
    return (tuple(tensor.dtype for tensor in tensors), tuple(tensor.shape for tensor in tensors),
            tuple(tensor.is_cuda for tensor in tensors))


class BulkCopy:
    """Copies a list of tensors laid out as ``views`` (same order, same structure) into them:
    one ``torch._foreach_copy_`` for the host tensors, one non-blocking one for the CUDA ones."""

    def __init__(self, views: Sequence[torch.Tensor], from_cuda: Sequence[bool]) -> None:
        self._host = [index for index, cuda in enumerate(from_cuda) if not cuda]
        self._cuda = [index for index, cuda in enumerate(from_cuda) if cuda]
        self._host_views = [views[index] for index in self._host]
        self._cuda_views = [views[index] for index in self._cuda]
        self._all_host = not self._cuda
        host_bytes = sum(view.nbytes for view in self._host_views)
        self._threads = one_intra_op_thread if host_bytes < SINGLE_THREAD_COPY_BYTES else contextlib.nullcontext

    def copy(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` (of the structure the views were laid out for) into the views."""
        if self._all_host:  # the common case: no regrouping of the sources
            if tensors:
                with self._threads():
                    torch._foreach_copy_(self._host_views, list(tensors))
            return
        if self._host:
            with self._threads():
                torch._foreach_copy_(self._host_views, [tensors[index] for index in self._host])
        torch._foreach_copy_(self._cuda_views, [tensors[index] for index in self._cuda], non_blocking=True)
