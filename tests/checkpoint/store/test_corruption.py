"""Torn, truncated, tampered and missing checkpoint files: inspect reports each, resume falls
back to the newest checkpoint that verifies (with a warning) and stays exact."""

import json
import uuid
import zlib

import fsspec
import pytest

import engine
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.cli.commands import inspect_run
from engine.checkpoint.store.storage import Storage
from resume_helpers import assert_same_run, copy_run_until
from scenarios import train_with_checkpoints


def damage_truncate(fs, directory):
    path = f"{directory}/tensors.bin"
    fs.pipe_file(path, fs.cat_file(path)[:-7])


def damage_flip_byte(fs, directory):
    path = f"{directory}/state.msgpack"
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x40
    fs.pipe_file(path, bytes(data))


def damage_missing_file(fs, directory):
    fs.rm_file(f"{directory}/progress.msgpack")


def damage_lying_manifest(fs, directory):
    """The manifest claims a size and checksum that the file does not have."""
    path = f"{directory}/MANIFEST.json"
    manifest = json.loads(fs.cat_file(path))
    manifest["files"]["tensors.bin"]["size"] += 64
    fs.pipe_file(path, json.dumps(manifest).encode())


def damage_consistent_lie(fs, directory):
    """File and manifest agree, but the file is not a valid state: checksums match garbage."""
    garbage = b"\x92\x01\x02 not a state"
    fs.pipe_file(f"{directory}/state.msgpack", garbage)
    path = f"{directory}/MANIFEST.json"
    manifest = json.loads(fs.cat_file(path))
    manifest["files"]["state.msgpack"] = {"size": len(garbage), "crc32": zlib.crc32(garbage)}
    fs.pipe_file(path, json.dumps(manifest).encode())


def damage_no_manifest(fs, directory):
    fs.rm_file(f"{directory}/MANIFEST.json")


def damage_garbage_manifest(fs, directory):
    fs.pipe_file(f"{directory}/MANIFEST.json", b"{ torn")


DAMAGES = {
    "truncated": (damage_truncate, "truncated"),
    "flipped byte": (damage_flip_byte, "CRC-32"),
    "missing file": (damage_missing_file, "missing"),
    "lying manifest": (damage_lying_manifest, "the manifest says"),
    "consistent lie": (damage_consistent_lie, "state.msgpack"),
    "no manifest": (damage_no_manifest, "never committed"),
    "garbage manifest": (damage_garbage_manifest, "not valid JSON"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_with_checkpoints("tbptt", run_dir, keep_last=None)
    return run_dir


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_newest_checkpoint_falls_back(damage, where, reference, tmp_path):
    damage_function, message = DAMAGES[damage]
    names = CheckpointStore(Storage(reference)).names()
    newest, previous = names[10], names[9]
    run_dir = str(tmp_path / "run") if where == "local" else f"memory://corrupt-{uuid.uuid4().hex}"
    copy_run_until(reference, run_dir, newest)
    fs, root = fsspec.core.url_to_fs(run_dir)
    damage_function(fs, f"{root}/checkpoints/{newest}")

    report = inspect_run(run_dir)
    entry = next(e for e in report["checkpoints"] if e["name"] == newest)
    assert entry["valid"] is False and message in entry["error"]
    assert report["latest"] == previous

    with pytest.warns(UserWarning, match=f"skipping checkpoint {newest}"):
        result = train_with_checkpoints("tbptt", run_dir, keep_last=None)
    assert result.resumed_from == previous
    assert_same_run(reference, run_dir)


def test_no_valid_checkpoint_is_an_error_not_a_fresh_start(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    names = CheckpointStore(Storage(reference)).names()
    copy_run_until(reference, run_dir, names[1])
    fs, root = fsspec.core.url_to_fs(run_dir)
    for name in names[:2]:
        damage_flip_byte(fs, f"{root}/checkpoints/{name}")
    with pytest.warns(UserWarning, match="skipping"), pytest.raises(engine.CheckpointCorrupt, match="none verifies"):
        train_with_checkpoints("tbptt", run_dir)


def test_staging_directories_are_ignored(reference, tmp_path):
    """A crashed local write leaves checkpoints/tmp-...: it is never taken for a checkpoint."""
    run_dir = str(tmp_path / "run")
    names = CheckpointStore(Storage(reference)).names()
    copy_run_until(reference, run_dir, names[3])
    fs, root = fsspec.core.url_to_fs(run_dir)
    fs.makedirs(f"{root}/checkpoints/tmp-0000000099-1234")
    fs.pipe_file(f"{root}/checkpoints/tmp-0000000099-1234/tensors.bin", b"partial")
    assert [e["name"] for e in inspect_run(run_dir)["checkpoints"]] == names[:4]
    result = train_with_checkpoints("tbptt", run_dir, keep_last=None)
    assert result.resumed_from == names[3]
    assert_same_run(reference, run_dir)


def test_manifest_declaring_a_huge_size_is_refused_without_allocating(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    names = CheckpointStore(Storage(reference)).names()
    copy_run_until(reference, run_dir, names[2])
    fs, root = fsspec.core.url_to_fs(run_dir)
    path = f"{root}/checkpoints/{names[2]}/MANIFEST.json"
    manifest = json.loads(fs.cat_file(path))
    manifest["files"]["tensors.bin"]["size"] = 2 ** 45
    fs.pipe_file(path, json.dumps(manifest).encode())
    report = inspect_run(run_dir)
    assert report["checkpoints"][2]["valid"] is False and "manifest says 35184372088832" in report["checkpoints"][2]["error"]
    assert report["latest"] == names[1]
