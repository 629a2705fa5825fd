"""The lighter local commit: a checkpoint retired by retention becomes the next one's staging
directory (its files overwritten in place), never a checkpoint again, and nothing of it
outlives the run; what is not a plain checkpoint directory is deleted, not reused."""

import os

import torch

from engine.checkpoint.format.codec import encode_state
from engine.checkpoint.store.request import CommitRequest
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from progress import Cursor, ProgressTree, encode_tree


def commit(store, sequence, size=2):
    cursor = Cursor(0, 0, sequence, 0)
    state = {"weight": torch.full((size,), float(sequence))}
    name = store.write(CommitRequest.of_state(encode_state(state), encode_tree(ProgressTree(cursor=cursor)), cursor, 1,
                                              sequence=sequence))
    store.apply_retention(2, 1)
    return name


def tensors_file(store, name):
    return os.path.join(store.storage.root, "checkpoints", name, "tensors.bin")


def test_a_retired_checkpoint_is_overwritten_in_place_by_the_next_one(tmp_path):
    store = CheckpointStore(Storage(str(tmp_path / "run")))
    first = commit(store, 1)
    pinned = tmp_path / "pinned"  # a second link keeps the inode from being freed and reused
    os.link(tensors_file(store, first), pinned)
    first_inode = os.stat(pinned).st_ino
    commit(store, 2)
    commit(store, 3)  # retires ckpt 1: it becomes the spare staging directory
    fourth = commit(store, 4)  # written into the spare
    assert os.stat(tensors_file(store, fourth)).st_ino == first_inode
    fresh = CheckpointStore(Storage(store.storage.url))  # a new process: nothing cached
    assert fresh.names() == ["ckpt-0000000003", "ckpt-0000000004"]
    assert torch.equal(fresh.load(fourth).state["weight"], torch.full((2,), 4.0))


def test_a_reused_file_longer_than_the_new_content_is_cut_to_size(tmp_path):
    store = CheckpointStore(Storage(str(tmp_path / "run")))
    for sequence in (1, 2):
        commit(store, sequence, size=4096)
    commit(store, 3, size=3)  # retires the big ckpt 1
    small = commit(store, 4, size=3)
    assert os.path.getsize(tensors_file(store, small)) == 3 * 4
    assert torch.equal(CheckpointStore(Storage(store.storage.url)).load(small).state["weight"], torch.full((3,), 4.0))


def test_the_spare_directory_is_gone_after_close(tmp_path):
    store = CheckpointStore(Storage(str(tmp_path / "run")))
    for sequence in (1, 2, 3):
        commit(store, sequence)
    assert any(entry.startswith("tmp-") for entry in os.listdir(os.path.join(store.storage.root, "checkpoints")))
    store.close()
    assert sorted(os.listdir(os.path.join(store.storage.root, "checkpoints"))) == ["ckpt-0000000002", "ckpt-0000000003"]


def test_a_retired_checkpoint_holding_a_symlink_is_deleted_not_reused(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep me")
    store = CheckpointStore(Storage(str(tmp_path / "run")))
    first = commit(store, 1)
    os.symlink(outside, os.path.join(store.storage.root, "checkpoints", first, "extra.bin"))
    commit(store, 2)
    commit(store, 3)
    fourth = commit(store, 4)
    assert outside.read_bytes() == b"keep me"
    assert not os.path.exists(os.path.join(store.storage.root, "checkpoints", first))
    assert torch.equal(CheckpointStore(Storage(store.storage.url)).load(fourth).state["weight"], torch.full((2,), 4.0))
