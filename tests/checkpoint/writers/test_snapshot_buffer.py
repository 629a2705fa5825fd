"""A snapshot's tensors reach their buffer in bulk (engine.checkpoint.writers.snapshot_buffer): one
``torch._foreach_copy_`` per snapshot, not one call per tensor; a structure change lays the
buffer out again; the copies are the tensors, bit for bit."""

import pytest
import torch

from engine.checkpoint.format.codec import encode_state
from engine.checkpoint.writers.buffers import SnapshotBuffers


def _layout(tensors):
    return encode_state({"tensors": tensors}).layout


def _mixed_state():
    return [torch.randn(3, 4), torch.arange(5), torch.tensor(True), torch.randn(0), torch.randn(7).to(torch.bfloat16)]


class CountingForeachCopy:
    def __init__(self, monkeypatch):
        self.calls = []
        original = torch._foreach_copy_

        def counted(views, sources, **kwargs):
            self.calls.append(len(views))
            return original(views, sources, **kwargs)

        monkeypatch.setattr(torch, "_foreach_copy_", counted)


def test_a_snapshot_of_host_tensors_is_one_bulk_copy(monkeypatch):
    tensors = _mixed_state()
    buffers = SnapshotBuffers()
    buffers.capture(tensors, _layout(tensors))  # lays the buffer out
    counting = CountingForeachCopy(monkeypatch)
    tensors[0].add_(1.0)
    tensors[1].mul_(3)
    copies = buffers.capture(tensors, _layout(tensors))
    assert counting.calls == [len(tensors)]
    assert all(torch.equal(copy, tensor) for copy, tensor in zip(copies, tensors))
    assert all(copy.data_ptr() != tensor.data_ptr() for copy, tensor in zip(copies, tensors) if tensor.numel())


@pytest.mark.parametrize("change", ["new entry", "dtype", "shape"])
def test_a_structure_change_lays_the_buffer_out_again(change):
    """A new optimizer state entry, a dtype change of the same size, a reshaped tensor: the
    next snapshot holds the new structure exactly, not the old views."""
    tensors = _mixed_state()
    buffers = SnapshotBuffers()
    first = buffers.capture(tensors, _layout(tensors))
    if change == "new entry":
        changed = tensors + [torch.randn(2, 2)]
    elif change == "dtype":
        changed = [tensors[0].view(torch.int32)] + tensors[1:]
    else:
        changed = [tensors[0].reshape(4, 3)] + tensors[1:]
    copies = buffers.capture(changed, _layout(changed))
    assert copies[0] is not first[0]
    assert [(c.dtype, c.shape) for c in copies] == [(t.dtype, t.shape) for t in changed]
    assert all(torch.equal(copy, tensor) for copy, tensor in zip(copies, changed))


@pytest.mark.gpu
def test_cuda_and_host_tensors_are_copied_in_two_bulk_copies(monkeypatch):
    """CUDA tensors go to pinned memory in one non-blocking bulk copy, host tensors in another;
    the writer's wait makes the copies complete."""
    host = _mixed_state()
    cuda = [torch.randn(5, 5, device="cuda"), torch.arange(3, device="cuda")]
    tensors = [cuda[0], host[0], cuda[1], *host[1:]]
    buffers = SnapshotBuffers()
    buffers.capture(tensors, _layout(tensors))
    counting = CountingForeachCopy(monkeypatch)
    cuda[0].mul_(2.0)
    copies = buffers.capture(tensors, _layout(tensors))
    buffers.wait_until_copied()
    assert sorted(counting.calls) == [len(cuda), len(host)]
    assert buffers.flat is not None and buffers.flat.is_pinned()
    assert all(torch.equal(copy, tensor.cpu()) for copy, tensor in zip(copies, tensors))


def test_a_small_snapshot_is_copied_on_one_intra_op_thread(monkeypatch):
    """Waking torch's intra-op workers for a small copy costs the training thread more CPU
    than the copy itself: a small state is copied with one thread, and the count restored."""
    threads_during_copies = []
    original = torch._foreach_copy_

    def recording(views, sources, **kwargs):
        threads_during_copies.append(torch.get_num_threads())
        return original(views, sources, **kwargs)

    monkeypatch.setattr(torch, "_foreach_copy_", recording)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tensors = _mixed_state()
        buffers = SnapshotBuffers()
        copies = buffers.capture(tensors, _layout(tensors))
        assert threads_during_copies == [1]
        assert torch.get_num_threads() == 2
        assert all(torch.equal(copy, tensor) for copy, tensor in zip(copies, tensors))
    finally:
        torch.set_num_threads(previous)
