"""Checkpoint files are checksummed with CRC-32C; checkpoints that recorded zlib's CRC-32 (the
format before) still verify, and a record naming no known checksum is refused."""

import json
import pathlib
import zlib

import pytest

from engine.checkpoint.format.checksum import CRC32, CRC32C, checksum
from engine.checkpoint.store.request import CommitRequest
from engine.checkpoint.format.manifest import FileRecord, verify_file
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.errors import CheckpointCorrupt
from resume_helpers import assert_same_run, copy_run_until
from scenarios import train_with_checkpoints


def test_crc32c_is_the_castagnoli_crc():
    # The check value of CRC-32C (iSCSI, RFC 3720) for the ASCII digits 1..9, computed whole
    # and in pieces.
    assert checksum([b"123456789"]) == 0xE3069283
    assert checksum([b"1234", memoryview(b"56789")]) == 0xE3069283
    assert checksum([b"123456789"], CRC32) == zlib.crc32(b"123456789") == 0xCBF43926


def _newest(run_dir):
    directory = max((pathlib.Path(run_dir) / "checkpoints").glob("ckpt-*"))
    return directory, json.loads((directory / "MANIFEST.json").read_text())


def test_new_checkpoints_record_crc32c_of_each_file(tmp_path):
    run_dir = str(tmp_path / "run")
    train_with_checkpoints("tbptt", run_dir, epochs=1)
    directory, manifest = _newest(run_dir)
    for name, record in manifest["files"].items():
        content = (directory / name).read_bytes()
        assert record == {"size": len(content), "crc32c": checksum([content])}


def _rewrite_with_zlib_crc32(directory, manifest):
    for name in manifest["files"]:
        content = (directory / name).read_bytes()
        manifest["files"][name] = {"size": len(content), "crc32": zlib.crc32(content)}
    (directory / "MANIFEST.json").write_text(json.dumps(manifest))


def test_a_checkpoint_of_the_former_crc32_format_verifies_and_resumes_exactly(tmp_path):
    reference = str(tmp_path / "reference")
    train_with_checkpoints("tbptt", reference)
    store = CheckpointStore(Storage(reference))
    middle = store.names()[len(store.names()) // 2]
    run_dir = str(tmp_path / "run")
    copy_run_until(reference, run_dir, middle)
    directory, manifest = _newest(run_dir)
    _rewrite_with_zlib_crc32(directory, manifest)
    assert CheckpointStore(Storage(run_dir)).latest().name == middle
    train_with_checkpoints("tbptt", run_dir)
    assert_same_run(reference, run_dir)


def test_a_damaged_file_fails_its_crc32_record_too(tmp_path):
    run_dir = str(tmp_path / "run")
    train_with_checkpoints("tbptt", run_dir, epochs=1)
    directory, manifest = _newest(run_dir)
    _rewrite_with_zlib_crc32(directory, manifest)
    content = bytearray((directory / "tensors.bin").read_bytes())
    content[len(content) // 3] ^= 0x01
    (directory / "tensors.bin").write_bytes(bytes(content))
    with pytest.raises(CheckpointCorrupt, match="tensors.bin: CRC-32 "):
        CheckpointStore(Storage(run_dir)).load(directory.name)


@pytest.mark.parametrize("record", [
    {"size": 3, "crc32": 1, "crc32c": 1},  # two checksums: which one is meant?
    {"size": 3, "md5": 1},
    {"size": 3},
    {"size": 3, "crc32c": 1 << 32},  # not a 32-bit value
    {"size": 3, "crc32c": "1"},
])
def test_a_file_record_without_exactly_one_known_checksum_is_corrupt(tmp_path, record):
    run_dir = str(tmp_path / "run")
    train_with_checkpoints("tbptt", run_dir, epochs=1)
    directory, manifest = _newest(run_dir)
    manifest["files"]["progress.msgpack"] = record
    (directory / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorrupt, match="MANIFEST.json is malformed"):
        CheckpointStore(Storage(run_dir)).load(directory.name)


def test_verify_names_the_checksum_that_failed():
    verify_file("a", b"abc", FileRecord(3, checksum([b"abc"]), CRC32C))
    with pytest.raises(CheckpointCorrupt, match="a: CRC-32C "):
        verify_file("a", b"abd", FileRecord(3, checksum([b"abc"]), CRC32C))
    with pytest.raises(CheckpointCorrupt, match="truncated"):
        verify_file("a", b"ab", FileRecord(3, checksum([b"abc"]), CRC32C))


@pytest.mark.parametrize("durable", [True, False])
def test_a_large_state_is_checksummed_while_its_files_reach_the_disk(tmp_path, durable):
    """States of 8 MB and more are checksummed in memory while the fsyncs run (the overlap
    path of the commit); the records must still be the files' CRC-32C."""
    import torch

    import progress
    from engine.checkpoint.format.codec import encode_state
    from engine.checkpoint.store.staged import _OVERLAP_CHECKSUM_BYTES

    weights = torch.arange(_OVERLAP_CHECKSUM_BYTES // 4 + 1000, dtype=torch.float32)
    store = CheckpointStore(Storage(str(tmp_path / "run")), durable=durable)
    name = store.write(CommitRequest.of_state(encode_state({"w": weights}), progress.encode_tree(progress.ProgressTree()),
                                              cursor=None, generation=0))
    directory = tmp_path / "run" / "checkpoints" / name
    manifest = json.loads((directory / "MANIFEST.json").read_text())
    for file_name, record in manifest["files"].items():
        assert record["crc32c"] == checksum([(directory / file_name).read_bytes()]), file_name
    assert torch.equal(CheckpointStore(Storage(str(tmp_path / "run"))).load(name).state["w"], weights)
