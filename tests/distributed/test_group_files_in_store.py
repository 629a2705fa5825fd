"""The store side of the commit across ranks: other ranks' files join the manifest, a shared
staging name, and the manifest check that admits only rank parts beside the main files."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from engine.checkpoint.codec import encode_state
from engine.checkpoint.commit import CommitRequest
from engine.checkpoint.manifest import FileRecord
from engine.checkpoint.storage import Storage
from engine.checkpoint.store import CheckpointStore
from engine.errors import CheckpointCorrupt
from progress import ProgressTree, encode_tree


def _write(tmp_path: pathlib.Path, extra_name: str) -> tuple[CheckpointStore, str]:
    store = CheckpointStore(Storage(str(tmp_path)))
    staging = "tmp-0000000001-123456"
    part = encode_state({"rng": {"seed": 2}})

    staged = store.stage(CommitRequest.of_state(encode_state({"w": torch.ones(2)}), encode_tree(ProgressTree(records={})),
                                                None, 1, sequence=1, staging=staging))
    # What another rank wrote into the staging directory, reported to rank 0.
    size, crc = store.storage.write(f"checkpoints/{staging}/{extra_name}", [part.header], durable=True)
    name = staged.commit({extra_name: FileRecord(size, crc)})
    return store, name


def test_a_rank_part_is_committed_listed_and_verified(tmp_path: pathlib.Path) -> None:
    store, name = _write(tmp_path, "rank-00001.msgpack")
    manifest = json.loads((tmp_path / "checkpoints" / name / "MANIFEST.json").read_text())
    assert "rank-00001.msgpack" in manifest["files"]
    loaded = CheckpointStore(Storage(str(tmp_path))).load(name)
    assert set(loaded.extra_files) == {"rank-00001.msgpack"}
    (tmp_path / "checkpoints" / name / "rank-00001.msgpack").write_bytes(b"torn")
    with pytest.raises(CheckpointCorrupt, match="rank-00001.msgpack"):
        CheckpointStore(Storage(str(tmp_path))).load(name)


def test_a_manifest_listing_other_files_is_corrupt(tmp_path: pathlib.Path) -> None:
    store, name = _write(tmp_path, "notes.txt")
    with pytest.raises(CheckpointCorrupt, match="rank-NNNNN"):
        CheckpointStore(Storage(str(tmp_path))).load(name)


def test_discarding_a_staging_directory_spares_committed_checkpoints(tmp_path: pathlib.Path) -> None:
    store, name = _write(tmp_path, "rank-00001.msgpack")
    store.storage.makedirs("checkpoints/tmp-0000000002-99")
    store.discard_staging("tmp-0000000002-99")
    store.discard_staging(name)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [name]
