"""Which entries of checkpoints/ are checkpoints, what a malformed one does to listing and
resume, what retention keeps, and which paths the engine refuses to write through."""

import errno
import os

import pytest
import torch

import engine
from engine.checkpoint.format.codec import encode_state
from engine.checkpoint.store.request import CommitRequest
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.local_storage import LocalStorage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.cli.commands import inspect_run
from engine.checkpoint.store.metrics_log import METRICS_FILE
from progress import Cursor, ProgressTree, encode_tree
from scenarios import train_with_checkpoints


def commit(store, sequence, generation=1):
    cursor = Cursor(0, 0, sequence, 0)
    return store.write(CommitRequest.of_state(encode_state({"weight": torch.full((2,), float(sequence))}),
                                              encode_tree(ProgressTree(cursor=cursor)), cursor, generation,
                                              sequence=sequence))


def trained(tmp_path, keep_last=None):
    run_dir = str(tmp_path / "run")
    train_with_checkpoints("plain", run_dir, epochs=1, keep_last=keep_last)
    store = CheckpointStore(Storage(run_dir))
    return run_dir, store, store.names()


# ---- names -------------------------------------------------------------------------------------
@pytest.mark.parametrize("stray", ["ckpt-\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669\u0660",  # Arabic-Indic digits
                                   "ckpt-0000000009\n", "ckpt-00000000009", "ckpt-000000009"])
def test_only_ten_ascii_digits_name_a_checkpoint(tmp_path, stray):
    store = CheckpointStore(Storage(str(tmp_path / "run")))
    commit(store, 1)
    os.makedirs(os.path.join(store.storage.root, "checkpoints", stray))
    assert store.names() == ["ckpt-0000000001"]
    assert store.next_sequence() == 2
    with pytest.raises(engine.CheckpointNotFound, match="ASCII digits"):
        store.load(stray)


def test_a_stray_last_sequence_number_is_refused_instead_of_an_unlisted_name(tmp_path):
    store = CheckpointStore(Storage(str(tmp_path / "run")))
    os.makedirs(os.path.join(store.storage.root, "checkpoints", "ckpt-9999999999"))
    with pytest.raises(engine.CheckpointWriteError, match="does not fit in 10 digits.*ckpt-9999999999"):
        commit(store, store.next_sequence())
    assert sorted(store.storage.list_names("checkpoints")) == ["ckpt-9999999999"]


# ---- malformed entries: CheckpointCorrupt, INVALID, fallback ------------------------------------
def make_file_named_like_a_checkpoint(store, names):
    with open(os.path.join(store.storage.root, "checkpoints", f"ckpt-{int(names[-1][5:]) + 1:010d}"), "wb") as handle:
        handle.write(b"not a directory")


def make_manifest_a_directory(store, names):
    newer = f"ckpt-{int(names[-1][5:]) + 1:010d}"
    os.makedirs(os.path.join(store.storage.root, "checkpoints", newer, "MANIFEST.json"))


@pytest.mark.parametrize("malform", [make_file_named_like_a_checkpoint, make_manifest_a_directory])
def test_a_file_or_directory_in_the_wrong_place_is_invalid_and_skipped(tmp_path, malform):
    run_dir, store, names = trained(tmp_path)
    malform(store, names)
    newer = f"ckpt-{int(names[-1][5:]) + 1:010d}"
    with pytest.raises(engine.CheckpointCorrupt, match=newer):
        store.load(newer)
    report = inspect_run(run_dir)
    entry = next(e for e in report["checkpoints"] if e["name"] == newer)
    assert entry["valid"] is False and newer in entry["error"]
    assert report["latest"] == names[-1]
    with pytest.warns(UserWarning, match=f"skipping checkpoint {newer}"):
        result = train_with_checkpoints("plain", run_dir, epochs=2, keep_last=None)
    assert result.resumed_from == names[-1]


def test_an_io_error_reading_the_newest_checkpoint_falls_back_to_the_previous(tmp_path, monkeypatch):
    run_dir, store, names = trained(tmp_path)
    original = LocalStorage.read_into

    def failing(self, relative, size):
        if relative.startswith(f"checkpoints/{names[-1]}/"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return original(self, relative, size)

    monkeypatch.setattr(LocalStorage, "read_into", failing)
    with pytest.raises(engine.CheckpointCorrupt, match=f"{names[-1]}: cannot be read: OSError"):
        store.load(names[-1])
    with pytest.warns(UserWarning, match=f"skipping checkpoint {names[-1]}"):
        assert CheckpointStore(Storage(run_dir)).latest().name == names[-2]
    assert inspect_run(run_dir)["latest"] == names[-2]


# ---- retention counts checkpoints that verify ----------------------------------------------------
def corrupt(store, name):
    path = os.path.join(store.storage.root, "checkpoints", name, "tensors.bin")
    with open(path, "r+b") as handle:
        first = handle.read(1)
        handle.seek(0)
        handle.write(bytes([first[0] ^ 0xFF]))


def test_keep_last_keeps_that_many_checkpoints_that_verify(tmp_path):
    store = CheckpointStore(Storage(str(tmp_path / "run")))
    for sequence in (1, 2, 3):
        commit(store, sequence)
    corrupt(store, "ckpt-0000000003")
    store = CheckpointStore(Storage(str(tmp_path / "run")))  # a new process: nothing cached
    commit(store, 4)
    store.apply_retention(keep_last=2)
    # 4 and 2 verify; the corrupt 3 is not counted (and, newer than 2, stays for inspection).
    assert store.names() == ["ckpt-0000000002", "ckpt-0000000003", "ckpt-0000000004"]
    commit(store, 5)
    store.apply_retention(keep_last=2)
    assert store.names() == ["ckpt-0000000004", "ckpt-0000000005"]


def test_after_resuming_past_a_corrupt_newest_checkpoint_the_valid_one_survives_retention(tmp_path):
    run_dir, store, names = trained(tmp_path, keep_last=2)
    assert len(names) == 2
    corrupt(store, names[-1])
    with pytest.warns(UserWarning, match=f"skipping checkpoint {names[-1]}"):
        result = train_with_checkpoints("plain", run_dir, epochs=1, keep_last=2)
    assert result.resumed_from == names[0]
    assert CheckpointStore(Storage(run_dir)).names() == [names[0], names[1], result.last_checkpoint]
    store = CheckpointStore(Storage(run_dir))
    valid = [info.name for info in store.inspect() if info.valid]
    assert len(valid) == 2
    assert names[0] in valid  # the checkpoint resumed from was not deleted
    for name in valid:
        store.load(name)


# ---- paths -------------------------------------------------------------------------------------
@pytest.mark.parametrize("run_dir", ["simplecache::memory://chained", "{tmp}/a::b"])
def test_a_run_dir_with_a_chained_url_is_refused(tmp_path, run_dir):
    run_dir = run_dir.format(tmp=tmp_path)
    with pytest.raises(engine.ConfigError, match="'::'.*chained URL"):
        Storage(run_dir)
    with pytest.raises(engine.ConfigError, match="chained URL"):
        train_with_checkpoints("plain", run_dir, epochs=1)
    assert not os.path.exists(str(tmp_path / "a::b"))


def test_a_symlinked_metrics_file_leaving_the_run_dir_is_refused(tmp_path):
    outside = tmp_path / "precious.txt"
    outside.write_bytes(b"someone else's file\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / METRICS_FILE).symlink_to(outside)
    with pytest.raises(engine.ConfigError, match="outside the run directory"):
        train_with_checkpoints("plain", str(run_dir), epochs=1)
    assert outside.read_bytes() == b"someone else's file\n"


def test_a_symlinked_checkpoints_dir_leaving_the_run_dir_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(engine.ConfigError, match="outside the run directory"):
        train_with_checkpoints("plain", str(run_dir), epochs=1)
    assert list(elsewhere.iterdir()) == []


def test_a_run_dir_that_is_itself_a_symlink_is_fine(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    result = train_with_checkpoints("plain", str(tmp_path / "link"), epochs=1)
    assert result.last_checkpoint in CheckpointStore(Storage(str(real))).names()


@pytest.mark.parametrize("where", ["checkpoints/tmp-0000000001-1", "checkpoints/tmp-0000000001-1/tensors.bin"])
def test_a_link_deeper_in_the_run_dir_leading_out_is_refused_after_the_top_was_resolved(tmp_path, where):
    """Top-level entries are resolved once per Storage; what lies below is checked on every
    write, so a link planted in checkpoints/ later is still refused."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    storage = Storage(str(tmp_path / "run"))
    storage.makedirs("checkpoints/tmp-0000000001-1")  # resolves checkpoints/ (cached)
    link = tmp_path / "run" / where
    if link.exists():
        link.rmdir()
    link.symlink_to(elsewhere / "target")
    with pytest.raises(engine.ConfigError, match="outside the run directory"):
        storage.writable_path(where)
    inside = tmp_path / "run" / "checkpoints" / "inner"
    inside.mkdir()
    (tmp_path / "run" / "checkpoints" / "alias").symlink_to(inside)
    assert storage.writable_path("checkpoints/alias/file").endswith("checkpoints/alias/file")
