"""ENOSPC / EIO from the filesystem (through engine.faults.faulty_fs.FaultyFileSystem): no valid
checkpoint is lost, the partial one is never taken for a checkpoint, and training stops with a
clear error (on_io_error="raise") or goes on (on_io_error="warn")."""

import uuid
import warnings

import pytest

import engine
from engine import faults
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.faults.faulty_fs import FaultyFileSystem
from engine.checkpoint.store.storage import Storage
from resume_helpers import assert_same_run
from scenarios import train_with_checkpoints


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_with_checkpoints("tbptt", run_dir)
    return run_dir


@pytest.fixture
def armed():
    def arm(*fault_list):
        faults.inject(list(fault_list))

    yield arm
    faults.clear()


def run_dir_for(where, tmp_path):
    return str(tmp_path / "run") if where == "local" else f"memory://io-{uuid.uuid4().hex}"


def committed_infos(run_dir):
    store = CheckpointStore(Storage(run_dir))
    return [info for info in store.inspect() if store._manifest_or_none(info.name) is not None]


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("kind", ["enospc", "eio"])
@pytest.mark.parametrize("hit", [20, 23, 37, 58, 101])
def test_io_error_with_raise_policy_loses_no_checkpoint(where, kind, hit, armed, reference, tmp_path):
    run_dir = run_dir_for(where, tmp_path)
    armed(faults.Fault("filesystem_write", hit, kind))
    expected = "No space left on device" if kind == "enospc" else "Input/output error"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            train_with_checkpoints("tbptt", run_dir)
            raised = None
        except engine.CheckpointWriteError as error:
            raised = str(error)
    faults.clear()
    retention = [str(w.message) for w in caught if "could not delete old checkpoint" in str(w.message)]
    ledger = [str(w.message) for w in caught if "could not append to the goodput ledger" in str(w.message)]
    # Either the write failed and training stopped, or only deleting an old checkpoint failed, or
    # only an append to the goodput ledger (it costs the ledger a row, never the run).
    assert (raised is not None and expected in raised) or (retention and expected in retention[0]) or \
        (ledger and expected in ledger[0] and raised is None)
    infos = committed_infos(run_dir)
    assert infos and all(info.valid for info in infos)
    assert all(not name.startswith("tmp-") for name in Storage(run_dir).list_names("checkpoints")) or where == "local"
    result = train_with_checkpoints("tbptt", run_dir)
    assert raised is None or result.resumed_from == infos[-1].name
    assert_same_run(reference, run_dir)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_io_error_with_warn_policy_trains_on(where, armed, reference, tmp_path):
    run_dir = run_dir_for(where, tmp_path)
    armed(faults.Fault("filesystem_write", 30, "enospc"), faults.Fault("filesystem_write", 31, "eio"))
    with pytest.warns(UserWarning, match="training goes on"):
        result = train_with_checkpoints("tbptt", run_dir, on_io_error="warn")
    assert result.epochs_completed == 2
    faults.clear()
    assert all(info.valid for info in committed_infos(run_dir))
    assert_same_run(reference, run_dir)


def test_faulty_filesystem_fails_only_write_calls(armed):
    import fsspec

    inner = fsspec.filesystem("memory")
    wrapped = FaultyFileSystem(inner)
    inner.pipe_file("/faulty-test/a", b"data")
    armed(faults.Fault("filesystem_write", 1, "eio"))
    assert wrapped.cat_file("/faulty-test/a") == b"data"  # reads are not arrivals
    with pytest.raises(OSError, match="Input/output error"):
        wrapped.pipe_file("/faulty-test/b", b"x")
    wrapped.pipe_file("/faulty-test/b", b"x")  # only the first arrival was armed
    assert inner.cat_file("/faulty-test/b") == b"x"
