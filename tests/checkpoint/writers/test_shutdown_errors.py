"""The error that stops a run is the one the user sees: errors met while the checkpointer
shuts down behind it (its last durable copy, the lease, the fast tier) become warnings."""

import warnings

import pytest

import engine
from engine import faults
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from resume_helpers import assert_same_run
from scenarios import train_with_checkpoints

NEVER = 10**6
# The disk fills up this many write calls before the run's last one (the lease's release): inside
# the durable copy of the run's last checkpoint, made while the run shuts down.
WRITES_BEFORE_THE_END = 4


def train(run_dir, fast):
    return train_with_checkpoints("tbptt", run_dir, tier=(fast, 1000), keep_last=None)


def write_calls_of_a_whole_run(tmp_path):
    faults.inject([faults.Fault("filesystem_write", NEVER, "eio")])  # armed, never reached: counts arrivals
    try:
        train(str(tmp_path / "counted"), str(tmp_path / "counted-fast"))
        return faults.arrivals("filesystem_write")
    finally:
        faults.clear()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_with_checkpoints("tbptt", run_dir)
    return run_dir


def test_a_full_disk_during_the_last_durable_copy_surfaces_as_the_write_error(tmp_path, reference):
    """Every write fails from inside the last durable copy on (a full disk): the copy's
    CheckpointWriteError surfaces, not the OSError of releasing the lease afterwards."""
    total = write_calls_of_a_whole_run(tmp_path)
    run_dir, fast = str(tmp_path / "run"), str(tmp_path / "fast")
    faults.inject([faults.Fault("filesystem_write", hit, "enospc")
                   for hit in range(total - WRITES_BEFORE_THE_END, total + 100)])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(engine.CheckpointWriteError, match="No space left on device") as raised:
                train(run_dir, fast)
    finally:
        faults.clear()
    last = CheckpointStore(Storage(fast), create=False).committed_names()[-1]
    assert f"writing checkpoint {last} failed" in str(raised.value)
    assert any("while stopping failed" in str(w.message) for w in caught), [str(w.message) for w in caught]
    # Nothing was lost: the fast tier holds the last checkpoint, and the run ends exact and durable.
    result = train(run_dir, fast)
    assert result.resumed_from == last
    assert_same_run(reference, run_dir)


def test_a_fast_checkpoint_lost_before_its_durable_copy_is_a_write_error(tmp_path, monkeypatch):
    """The fast tier loses the checkpoint its durable copy is about to read (its /dev/shm wiped
    under the run): a CheckpointWriteError under on_io_error, not a CheckpointNotFound escaping
    from the run's shutdown."""
    original = CheckpointStore.copy_from

    def copy_after_the_source_vanished(self, source, name, *args, **kwargs):
        source.storage.remove_tree(f"checkpoints/{name}")
        return original(self, source, name, *args, **kwargs)

    monkeypatch.setattr(CheckpointStore, "copy_from", copy_after_the_source_vanished)
    run_dir, fast = str(tmp_path / "run"), str(tmp_path / "fast")
    with pytest.raises(engine.CheckpointWriteError, match="durable tier failed: CheckpointNotFound"):
        train(run_dir, fast)
    with pytest.warns(UserWarning, match="training goes on.*durable tier failed"):
        result = train_with_checkpoints("tbptt", str(tmp_path / "warned"), tier=(str(tmp_path / "warned-fast"), 4),
                                        on_io_error="warn")
    assert result.epochs_completed == 2
