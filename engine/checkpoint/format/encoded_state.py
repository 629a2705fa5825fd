"""An encoded state tree as the writers take it: its msgpack header and the bytes of tensors.bin.

Torch-free at import: the writer process (engine.checkpoint.writers.process.main) builds one from the
bytes of a shared-memory slot (a ``memoryview``) and never imports torch; the training process
builds them from tensors (engine.checkpoint.format.codec.encode_state).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class EncodedState:
    """A state tree split into its msgpack description and the tensors to write raw."""

    def __init__(self, header: bytes, tensors: list[torch.Tensor], layout: list[tuple[int, int]],
                 flat: torch.Tensor | memoryview | None = None) -> None:
        self.header = header
        self.tensors = tensors
        self.layout = layout  # (offset, nbytes) per tensor
        # tensors.bin whole (padding included), of which ``tensors`` are views: a snapshot, one
        # chunk to write. A CPU uint8 tensor (engine.checkpoint.writers.buffers.SnapshotBuffers), or the
        # bytes of a shared-memory slot in the writer process (no tensors there).
        self.flat = flat

    @property
    def tensor_bytes(self) -> int:
        return self.layout[-1][0] + self.layout[-1][1] if self.layout else 0

    def tensor_chunks(self) -> list[memoryview | bytes]:
        """The content of tensors.bin, as buffers (no copy of tensor data)."""
        if isinstance(self.flat, memoryview):
            return [self.flat]
        # Imported here: a state with tensors comes from a process that has torch already.
        from engine.checkpoint.format.tensor_bytes import tensor_bytes_view

        if self.flat is not None:
            return [tensor_bytes_view(self.flat)]
        chunks: list[memoryview | bytes] = []
        position = 0
        for tensor, (offset, nbytes) in zip(self.tensors, self.layout):
            if offset > position:
                chunks.append(bytes(offset - position))
            if nbytes:
                chunks.append(memoryview(tensor_bytes_view(tensor if tensor.device.type == "cpu" else tensor.cpu())))
            position = offset + nbytes
        return chunks
