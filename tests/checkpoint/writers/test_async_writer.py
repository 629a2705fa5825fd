"""Asynchronous checkpoints: same checkpoints as synchronous ones, bounded snapshots, reused
buffers, background errors surfacing on the training thread, pending writes flushed on exit."""


import pytest
import torch

import engine
from engine.checkpoint.format.codec import EncodedState, encode_state
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.writers.buffers import SnapshotBuffers
from engine.checkpoint.store.storage import Storage
from progress import Cursor
from paced_writes import PacedWrites
from resume_helpers import assert_resumes_are_exact, assert_same_run, memory_url
from scenarios import train_with_checkpoints


def test_async_run_equals_sync_run(tmp_path):
    sync_dir = str(tmp_path / "sync")
    async_dir = str(tmp_path / "async")
    train_with_checkpoints("accumulate_splits", sync_dir, keep_last=None)
    train_with_checkpoints("accumulate_splits", async_dir, keep_last=None, asynchronous=True)
    assert_same_run(sync_dir, async_dir)
    sync_names = CheckpointStore(Storage(sync_dir)).names()
    assert CheckpointStore(Storage(async_dir)).names() == sync_names  # none skipped with "wait"


def test_resume_from_every_async_checkpoint():
    reference = memory_url("async")
    train_with_checkpoints("tbptt_several_optimizers", reference, keep_last=None, asynchronous=True)
    names = CheckpointStore(Storage(reference)).names()
    assert_resumes_are_exact(reference, names[:-1:3], lambda run_dir: train_with_checkpoints(
        "tbptt_several_optimizers", run_dir, asynchronous=True))


def test_skip_policy_replaces_a_queued_snapshot_with_the_newest(monkeypatch):
    # Each write lasts two splits: the snapshot queued behind it is replaced by a newer one.
    paced = PacedWrites(monkeypatch, splits=2)
    from scenarios import build

    model, loader = build("tbptt")
    run_dir = memory_url("async")
    checkpoint = engine.CheckpointConfig(every_n_splits=1, keep_last=None, writer="thread", when_behind="skip",
                                         max_in_flight=2)
    config = engine.TrainerConfig(max_epochs=1, run_dir=run_dir, checkpoint=checkpoint, progress_bar="off")
    engine.Trainer(config, callbacks=[paced.callback]).fit(model, loader)
    cursors = [CheckpointStore(Storage(run_dir)).load(n).progress.cursor for n in CheckpointStore(Storage(run_dir)).names()]
    assert 1 < len(cursors) < 13
    assert cursors == sorted(cursors, key=lambda c: c.as_tuple())  # always forward, newest last
    assert cursors[-1] == Cursor(0, 2, 3, 0)


def test_skip_policy_drops_checkpoints_while_the_writer_is_busy(monkeypatch, tmp_path):
    reference = str(tmp_path / "reference")
    train_with_checkpoints("tbptt", reference)
    paced = PacedWrites(monkeypatch, splits=2)  # each write lasts two splits: the one after it is skipped
    run_dir = memory_url("async")
    from scenarios import build

    model, loader = build("tbptt")
    checkpoint = engine.CheckpointConfig(every_n_splits=1, keep_last=None, writer="thread", when_behind="skip")
    config = engine.TrainerConfig(max_epochs=2, run_dir=run_dir, checkpoint=checkpoint, progress_bar="off",
                                  gradient_clip_val=0.5)
    result = engine.Trainer(config, callbacks=[paced.callback]).fit(model, loader)
    names = CheckpointStore(Storage(run_dir)).names()
    assert 1 < len(names) < 26  # some were skipped, the last one (forced) was not
    assert CheckpointStore(Storage(run_dir)).latest().progress.cursor == result.cursor == Cursor(1, 2, 3, 0)
    assert_same_run(reference, run_dir)


def test_wait_policy_bounds_snapshots_in_flight(monkeypatch, tmp_path):
    # Each write lasts until the next split ends; training waits for it (no split ends
    # meanwhile), so each waited-for write ends after at_most_seconds: short, for the CI time.
    paced = PacedWrites(monkeypatch, at_most_seconds=0.05)
    in_flight = []
    from engine.checkpoint.writers import writer as writer_module

    original_submit = writer_module.BackgroundWriter.submit

    def submit(self, pending, force=False):
        written = original_submit(self, pending, force)
        in_flight.append((len(self._queue), 1 - len(self._free)))  # queued, buffer sets in use
        return written

    monkeypatch.setattr(writer_module.BackgroundWriter, "submit", submit)
    train_with_checkpoints("tbptt", str(tmp_path / "run"), asynchronous=True, callbacks=(paced.callback,))
    assert in_flight and max(queued for queued, _ in in_flight) <= 1
    assert max(in_use for _, in_use in in_flight) <= 1


def _layout(tensors):
    return encode_state({"tensors": tensors}).layout


def test_snapshot_buffers_are_reused():
    buffers = SnapshotBuffers()
    tensors = [torch.randn(3, 4), torch.arange(5)]
    first = buffers.capture(tensors, _layout(tensors))
    flat = buffers.flat
    tensors[0].add_(1.0)
    second = buffers.capture(tensors, _layout(tensors))
    assert all(a is b for a, b in zip(first, second)) and buffers.flat is flat
    assert torch.equal(second[0], tensors[0]) and second[0].data_ptr() != tensors[0].data_ptr()
    changed = [torch.randn(2, 2), torch.arange(5)]
    third = buffers.capture(changed, _layout(changed))
    assert third[0] is not first[0] and all(torch.equal(a, b) for a, b in zip(third, changed))


def test_a_snapshot_is_one_chunk_laid_out_as_tensors_bin():
    """The snapshot's buffer holds tensors.bin byte for byte (padding zeros included), so the
    writer writes it as one chunk."""
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int16), torch.tensor(True), torch.randn(0)]
    encoded = encode_state({"tensors": tensors})
    expected = b"".join(bytes(chunk) for chunk in encoded.tensor_chunks())
    buffers = SnapshotBuffers()
    buffers.capture([torch.full_like(t, 7) for t in tensors], encoded.layout)  # a first state
    copies = buffers.capture(encoded.tensors, encoded.layout)
    snapshot = EncodedState(encoded.header, copies, encoded.layout, flat=buffers.flat)
    (chunk,) = snapshot.tensor_chunks()
    assert bytes(chunk) == expected and len(expected) == encoded.tensor_bytes


class RaiseAt(engine.Callback):
    def __init__(self, at):
        self.at = at
        self.seen = 0

    def on_split_end(self, view):
        self.seen += 1
        if self.seen == self.at:
            raise RuntimeError("boom")


def test_pending_writes_are_flushed_when_training_fails(monkeypatch, tmp_path):
    paced = PacedWrites(monkeypatch)  # each write lasts one split: one is in flight when training fails
    run_dir = str(tmp_path / "run")
    with pytest.raises(RuntimeError, match="boom"):
        train_with_checkpoints("tbptt", run_dir, asynchronous=True, callbacks=(paced.callback, RaiseAt(7)))
    # split 6 (epoch 0, batch 1, split 1) was queued before the failure and is committed
    assert CheckpointStore(Storage(run_dir)).latest().progress.cursor == Cursor(0, 1, 1, 0)


def test_background_error_reaches_the_training_thread(tmp_path):
    from engine import faults

    run_dir = str(tmp_path / "run")
    faults.inject([faults.Fault("checkpoint_before_manifest", 4, "eio")])
    try:
        with pytest.raises(engine.CheckpointWriteError, match="Input/output error"):
            train_with_checkpoints("tbptt", run_dir, asynchronous=True)
    finally:
        faults.clear()
    store = CheckpointStore(Storage(run_dir))
    assert [info.valid for info in store.inspect()] == [True, True, True]
