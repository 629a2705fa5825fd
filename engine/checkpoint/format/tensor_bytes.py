"""The bytes of a tensor without a copy: the raw bytes tensors.bin holds (engine.checkpoint.format.codec
lays them out; engine.checkpoint.format.encoded_state hands them to the writers)."""

from __future__ import annotations

import ctypes

import torch


def tensor_bytes_view(tensor: torch.Tensor) -> memoryview:
    """A byte memoryview of a contiguous CPU tensor's memory, without a copy and without NumPy
    (which is optional). The view keeps the tensor alive."""
    if tensor.is_cpu and tensor.is_contiguous():
        # Its bytes start at data_ptr(), offset included: no view to make (a reshape and a dtype
        # view cost a few microseconds each, paid per tensor at every checkpoint's digest).
        size = tensor.numel() * tensor.element_size()
        if size == 0:
            return memoryview(b"")
        buffer = (ctypes.c_ubyte * size).from_address(tensor.data_ptr())
        buffer._tensor = tensor  # type: ignore[attr-defined]  # the memory must outlive the view
        return memoryview(buffer).cast("B")
    flat = (tensor.reshape(-1) if tensor.dim() != 1 else tensor).view(torch.uint8)
    if flat.numel() == 0:
        return memoryview(b"")
    buffer = (ctypes.c_ubyte * flat.numel()).from_address(flat.data_ptr())
    buffer._tensor = flat  # type: ignore[attr-defined]  # the memory must outlive the view
    return memoryview(buffer).cast("B")
