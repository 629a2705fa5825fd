"""The store side of the commit across ranks: other ranks' files join the manifest, a shared
staging name, and the manifest check that admits only rank parts beside the main files."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from engine.checkpoint.format.codec import encode_state
from engine.checkpoint.store.request import CommitRequest
from engine.checkpoint.format.manifest import FileRecord
from engine.checkpoint.format.rank_files import rank_files
from engine.checkpoint.format.state_keys import CALLBACKS, LOOPS, MODULE, RNG, SIGNATURE
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.errors import CheckpointCorrupt
from progress import ProgressTree, encode_tree


RANK_1_PART = {RNG: {"seed": 2}, LOOPS: {}, CALLBACKS: {}}


def _write(tmp_path: pathlib.Path, extra_files: dict[str, list[memoryview | bytes]]) -> tuple[CheckpointStore, str]:
    """Rank 0's checkpoint of a two-rank run, with ``extra_files`` written into the staging
    directory as another rank would, and reported to rank 0."""
    store = CheckpointStore(Storage(str(tmp_path)))
    staging = "tmp-0000000001-123456"
    state = {MODULE: {"w": torch.ones(2)}, SIGNATURE: {"world_size": 2}, **RANK_1_PART}
    staged = store.stage(CommitRequest.of_state(encode_state(state), encode_tree(ProgressTree(records={})),
                                                None, 1, sequence=1, staging=staging))
    records = {}
    for file_name, chunks in extra_files.items():
        records[file_name] = FileRecord(*store.storage.write(f"checkpoints/{staging}/{file_name}", chunks, durable=True))
    return store, staged.commit(records)


def rank_1_files() -> dict[str, list[memoryview | bytes]]:
    part = encode_state(RANK_1_PART)
    tensors_file, header_file = rank_files(1)
    return {tensors_file: part.tensor_chunks(), header_file: [part.header]}


def test_a_rank_part_is_committed_listed_and_verified(tmp_path: pathlib.Path) -> None:
    store, name = _write(tmp_path, rank_1_files())
    manifest = json.loads((tmp_path / "checkpoints" / name / "MANIFEST.json").read_text())
    assert set(rank_files(1)) <= set(manifest["files"])
    loaded = CheckpointStore(Storage(str(tmp_path))).load(name)
    assert set(loaded.extra_files) == set(rank_files(1))
    (tmp_path / "checkpoints" / name / "rank-00001.msgpack").write_bytes(b"torn")
    with pytest.raises(CheckpointCorrupt, match="rank-00001.msgpack"):
        CheckpointStore(Storage(str(tmp_path))).load(name)


def test_a_manifest_listing_other_files_is_corrupt(tmp_path: pathlib.Path) -> None:
    store, name = _write(tmp_path, {**rank_1_files(), "notes.txt": [b"notes"]})
    with pytest.raises(CheckpointCorrupt, match="rank-NNNNN"):
        CheckpointStore(Storage(str(tmp_path))).load(name)


def test_discarding_a_staging_directory_spares_committed_checkpoints(tmp_path: pathlib.Path) -> None:
    store, name = _write(tmp_path, rank_1_files())
    store.storage.makedirs("checkpoints/tmp-0000000002-99")
    store.discard_staging("tmp-0000000002-99")
    store.discard_staging(name)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [name]
