"""The reused CPU buffers a snapshot's tensors are copied into (the background writer's and,
shared, the writer process's: engine.checkpoint.writers.process.arena).

This module imports no torch at import time: the writer process imports the writers without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.checkpoint.writers.snapshot_buffer import BulkCopy, StructureKey


class SnapshotBuffers:
    """One CPU buffer laid out as tensors.bin, reused from one snapshot to the next
    (reallocated only when the layout changes, e.g. a hidden state appearing after the first
    split). The tensors are copied into their typed views of the buffer in bulk
    (engine.checkpoint.writers.snapshot_buffer: one ``torch._foreach_copy_``, not one call per tensor),
    so that the writer writes and checksums one contiguous chunk, padding included (zeros,
    never written).

    A CUDA tensor is copied into a *pinned* buffer with a non-blocking copy, and a CUDA event is
    recorded after the copies on the stream that runs them: the training thread only launches
    the copies, and the next optimizer step, queued behind them on the same stream, cannot
    change a tensor before it is copied. The writer thread calls :meth:`wait_until_copied`
    before it reads the buffers. CPU tensors are copied synchronously, as before."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._key: StructureKey | None = None
        # The structure object of the layout the buffer was laid out for, when the layout came
        # from engine.checkpoint.format.codec (a Layout): the same object again means the same
        # structure, so the tensors' dtypes and shapes need not be read again.
        self._structure: object | None = None
        self._copy: BulkCopy | None = None
        self._cuda_devices: set[torch.device] = set()
        self._copied: list[torch.cuda.Event] = []

    @property
    def flat(self) -> torch.Tensor | None:
        """The buffer of the last :meth:`capture` (None before the first)."""
        return self._flat

    def capture(self, tensors: list[torch.Tensor], layout: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Copy ``tensors`` into the buffer at ``layout``'s (offset, nbytes); their views."""
        # Imported here, as torch in _allocate: the writer process imports this module without torch.
        from engine.checkpoint.writers.snapshot_buffer import BulkCopy, structure_key

        # The layout follows from the dtypes, shapes and devices (engine.checkpoint.format.codec.encode_state).
        structure = getattr(layout, "structure", None)
        if structure is None or structure is not self._structure or self._copy is None:
            key = structure_key(tensors)
            if key != self._key or self._copy is None:
                self._key, self._structure, self._copy = None, None, None  # a failed allocation leaves no half layout
                from_cuda = key[2]
                self._allocate(tensors, layout, pinned=any(from_cuda))
                self._copy = BulkCopy(self._views, from_cuda)
                self._cuda_devices = {tensor.device for tensor in tensors if tensor.is_cuda}
                self._key = key
            self._structure = structure
        self._copy.copy(tensors)
        self._copied = [self._record_event(device) for device in self._cuda_devices]
        return list(self._views)

    def _allocate(self, tensors: list[torch.Tensor], layout: list[tuple[int, int]], pinned: bool) -> None:
        import torch

        total = layout[-1][0] + layout[-1][1] if layout else 0
        self._flat = None  # the old buffer may be large: free it before allocating the new one
        flat = torch.zeros(total, dtype=torch.uint8, pin_memory=pinned)
        self._views = [flat[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
                       for tensor, (offset, nbytes) in zip(tensors, layout)]
        self._flat = flat

    @staticmethod
    def _record_event(device: torch.device) -> torch.cuda.Event:
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def wait_until_copied(self) -> None:
        """Block until the device-to-host copies of the last :meth:`capture` are done."""
        for event in self._copied:
            event.synchronize()
        self._copied = []
