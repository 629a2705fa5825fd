"""Things planted in a run directory in place of the engine's files: a FIFO (which used to
block the reader forever), a link to a device (read without end until memory ran out), links
leading out of the run directory (a checkpoint of another run resumed from). Each is reported
and skipped, without hanging, and nothing outside the run directory is read."""

import json
import os
import resource
import shutil
import subprocess
import sys

import pytest

import engine

from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from engine.cli.commands import inspect_run
from resume_helpers import assert_same_run, copy_run_until
from scenarios import train_with_checkpoints

# A FIFO blocked the old reader in open(): the timeout turns such a regression into a failure.
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_with_checkpoints("tbptt", run_dir, every=4, keep_last=None)
    return run_dir


def _copy(reference, run_dir):
    """A copy of the reference run; returns its newest checkpoint's directory and the name of
    the one before."""
    names = CheckpointStore(Storage(reference)).names()
    copy_run_until(reference, run_dir, names[-1])
    return os.path.join(run_dir, "checkpoints", names[-1]), names[-2]


def _set_manifest_record(checkpoint, file_name, record):
    path = os.path.join(checkpoint, "MANIFEST.json")
    with open(path) as handle:
        manifest = json.load(handle)
    manifest["files"][file_name] = record
    with open(path, "w") as handle:
        json.dump(manifest, handle)


def _entry(report, checkpoint):
    return next(e for e in report["checkpoints"] if e["name"] == os.path.basename(checkpoint))


@pytest.mark.parametrize("file_name", ["MANIFEST.json", "progress.msgpack"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_invalid_without_blocking(file_name, reference, tmp_path):
    checkpoint, previous = _copy(reference, str(tmp_path / "run"))
    if file_name != "MANIFEST.json":
        # A manifest that records the size a FIFO reports, so the size check lets it through.
        _set_manifest_record(checkpoint, file_name, {"size": 0, "crc32c": 0})
    os.remove(os.path.join(checkpoint, file_name))
    os.mkfifo(os.path.join(checkpoint, file_name))

    report = inspect_run(str(tmp_path / "run"))
    entry = _entry(report, checkpoint)
    assert entry["valid"] is False and "not a regular file" in entry["error"] and file_name in entry["error"]
    assert report["latest"] == previous


@pytest.mark.parametrize("what", ["checkpoint directory", "tensors.bin"])
def test_a_link_leading_out_of_the_run_dir_is_not_read(what, reference, tmp_path):
    checkpoint, previous = _copy(reference, str(tmp_path / "run"))
    outside = tmp_path / "outside"
    # The link leads to an exact copy: it would verify if it were followed.
    if what == "checkpoint directory":
        shutil.copytree(checkpoint, outside)
        shutil.rmtree(checkpoint)
        os.symlink(outside, checkpoint)
    else:
        shutil.copyfile(os.path.join(checkpoint, what), outside)
        os.remove(os.path.join(checkpoint, what))
        os.symlink(outside, os.path.join(checkpoint, what))

    report = inspect_run(str(tmp_path / "run"))
    entry = _entry(report, checkpoint)
    assert entry["valid"] is False and "outside the run directory" in entry["error"]
    assert report["latest"] == previous


def test_resume_never_uses_a_checkpoint_linked_in_from_outside(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    checkpoint, previous = _copy(reference, run_dir)
    shutil.move(checkpoint, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", checkpoint)

    with pytest.warns(UserWarning, match="outside the run directory"):
        result = train_with_checkpoints("tbptt", run_dir, every=4, keep_last=None)
    assert result.resumed_from == previous
    assert_same_run(reference, run_dir)


def test_a_link_that_stays_inside_the_run_dir_is_read(reference, tmp_path):
    checkpoint, _ = _copy(reference, str(tmp_path / "run"))
    kept = tmp_path / "run" / "kept-tensors.bin"
    shutil.move(os.path.join(checkpoint, "tensors.bin"), kept)
    os.symlink(kept, os.path.join(checkpoint, "tensors.bin"))
    assert inspect_run(str(tmp_path / "run"))["latest"] == os.path.basename(checkpoint)


def test_a_writer_lease_that_is_a_fifo_blocks_neither_inspect_nor_resume(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    checkpoint, _ = _copy(reference, run_dir)
    os.remove(os.path.join(run_dir, "writer.lease"))
    os.mkfifo(os.path.join(run_dir, "writer.lease"))

    assert inspect_run(run_dir)["latest"] == os.path.basename(checkpoint)
    result = train_with_checkpoints("tbptt", run_dir, every=4, keep_last=None)
    assert result.resumed_from == os.path.basename(checkpoint)
    assert_same_run(reference, run_dir)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_storage_read_refuses_what_is_not_a_regular_file(kind, tmp_path):
    path = tmp_path / "thing"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    with pytest.raises(OSError, match="thing"):  # UnreadableFile, an OSError as every reader expects
        Storage(str(tmp_path)).read("thing")


def test_storage_read_stops_at_its_limit(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 1000)
    assert Storage(str(tmp_path)).read("big", 10) == b"x" * 10
    assert Storage(str(tmp_path)).read("big") == b"x" * 1000


def _limit_memory():
    # A regression reads /dev/zero until memory runs out: let it fail in this process alone.
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.slow
def test_inspect_of_a_run_dir_with_devices_and_fifos_planted_reports_them(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    checkpoint, previous = _copy(reference, run_dir)
    os.remove(os.path.join(checkpoint, "MANIFEST.json"))
    os.symlink("/dev/zero", os.path.join(checkpoint, "MANIFEST.json"))
    os.remove(os.path.join(run_dir, "writer.lease"))
    os.mkfifo(os.path.join(run_dir, "writer.lease"))

    process = subprocess.run([sys.executable, "-m", "engine", "inspect", run_dir, "--json"], capture_output=True,
                             text=True, timeout=100, preexec_fn=_limit_memory)
    assert process.returncode == 0, (process.returncode, process.stderr[-2000:])
    report = json.loads(process.stdout)
    entry = _entry(report, checkpoint)
    assert entry["valid"] is False and "/dev/zero" in entry["error"]
    assert report["latest"] == previous


# ---- generations a manifest cannot hold --------------------------------------------------


def _set_lease_generation(run_dir, generation):
    path = os.path.join(run_dir, "writer.lease")
    with open(path) as handle:
        lease = json.load(handle)
    lease["generation"] = generation
    with open(path, "w") as handle:
        json.dump(lease, handle)


def test_a_checkpoint_at_the_largest_generation_stops_the_run_before_it_writes_unreadable_ones(reference, tmp_path):
    # The next writer's generation would be 2**63, which no manifest holds: every checkpoint it
    # wrote used to be unreadable, and its work lost at the next resume.
    run_dir = str(tmp_path / "run")
    checkpoint, _ = _copy(reference, run_dir)
    path = os.path.join(checkpoint, "MANIFEST.json")
    with open(path) as handle:
        manifest = json.load(handle)
    manifest["writer_generation"] = 2 ** 63 - 1
    with open(path, "w") as handle:
        json.dump(manifest, handle)
    before = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))

    with pytest.raises(engine.CheckpointWriteError, match="largest a manifest holds"):
        train_with_checkpoints("tbptt", run_dir, epochs=3, every=4, keep_last=None)
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == before


def test_a_lease_generation_no_manifest_holds_is_ignored_like_a_malformed_one(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    checkpoint, _ = _copy(reference, run_dir)
    _set_lease_generation(run_dir, 10 ** 30)

    result = train_with_checkpoints("tbptt", run_dir, epochs=3, every=4, keep_last=None)
    assert result.resumed_from == os.path.basename(checkpoint)
    report = inspect_run(run_dir)
    written_after = [e for e in report["checkpoints"] if e["name"] > os.path.basename(checkpoint)]
    assert written_after and all(e["valid"] for e in written_after), written_after


def test_a_huge_manifest_on_another_filesystem_is_read_only_to_the_limit():
    storage = Storage(f"memory://hostile-{os.getpid()}")
    storage.fs.pipe_file(storage.path("big"), b"x" * 1000)
    assert storage.read("big", 10) == b"x" * 10
    assert storage.read("big") == b"x" * 1000


def test_a_fast_tier_marker_that_is_a_fifo_does_not_block_the_run(tmp_path):
    fast = tmp_path / "fast"
    fast.mkdir()
    os.mkfifo(fast / "tier.json")
    # An unreadable marker is no marker: the tier starts over, as a fresh one does.
    result = train_with_checkpoints("tbptt", str(tmp_path / "run"), epochs=1, every=4, tier=(str(fast), 2))
    assert result.epochs_completed == 1
    assert (fast / "tier.json").is_file()
