"""tensor_bytes_view: a contiguous CPU tensor's bytes, read in place, are exactly the bytes of its
elements (offsets into a larger storage, every dtype, empty and scalar tensors, tensors that
require grad), and the view keeps the tensor's memory alive."""

import gc

import pytest
import torch

from engine.checkpoint.format.tensor_bytes import tensor_bytes_view


def expected_bytes(tensor: torch.Tensor) -> bytes:
    """The elements' bytes by another road: a copy through torch's own byte view."""
    return bytes(tensor.detach().clone().reshape(-1).view(torch.uint8).tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int8, torch.uint8, torch.bool, torch.complex64])
def test_the_view_holds_exactly_the_elements_bytes(dtype):
    values = (torch.arange(60, dtype=torch.float64) * 1.37 - 20).reshape(3, 4, 5)
    tensor = values.to(dtype) if dtype is not torch.bool else values > 0
    assert bytes(tensor_bytes_view(tensor)) == expected_bytes(tensor)


@pytest.mark.parametrize("make", [
    lambda base: base[2:5],  # a contiguous slice: its bytes start past the storage's start
    lambda base: base[1],  # one row of a matrix
    lambda base: base.reshape(-1)[7:8].reshape(()),  # a scalar inside a larger storage
    lambda base: base[:0],  # empty
    lambda base: base.t(),  # not contiguous: read through a contiguous copy by the caller
    lambda base: torch.nn.Parameter(base.clone()),  # requires grad
], ids=["slice", "row", "scalar", "empty", "transposed", "parameter"])
def test_offsets_empty_and_grad_requiring_tensors(make):
    base = torch.randn(6, 8)
    tensor = make(base)
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    assert bytes(tensor_bytes_view(tensor)) == expected_bytes(tensor)


def test_the_view_keeps_the_memory_alive():
    view = tensor_bytes_view(torch.full((1024,), 3.5))
    gc.collect()
    torch.zeros(4096)  # memory the freed tensor's would have been reused for
    assert bytes(view) == expected_bytes(torch.full((1024,), 3.5))
