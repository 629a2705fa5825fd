"""The reader sketch in docs/checkpoint-format.md ("A reader without splitloop") reads real
checkpoints: both checksum records, and the listing of a distributed checkpoint (rank files)."""

import json
import pathlib
import re
import zlib

import pytest
import torch

from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from scenarios import train_with_checkpoints

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "checkpoint-format.md"


def _reader():
    """``read_checkpoint`` as the doc defines it (its usage lines at the end left out)."""
    text = DOC.read_text()
    section = text[text.index("## A reader without splitloop"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    definitions = code[:code.index("\nmanifest, progress_tree, state = read_checkpoint")]
    namespace: dict = {}
    exec(compile(definitions, str(DOC), "exec"), namespace)
    return namespace["read_checkpoint"]


def _assert_module_matches(state, loaded):
    module = loaded.state["module"]
    assert set(state["module"]) == set(module)
    for name, tensor in module.items():
        assert torch.equal(torch.from_numpy(state["module"][name].copy()).reshape(tensor.shape), tensor), name


@pytest.mark.parametrize("former_crc32", [False, True])
def test_the_documented_reader_verifies_and_decodes_a_checkpoint(tmp_path, former_crc32):
    run_dir = str(tmp_path / "run")
    train_with_checkpoints("tbptt", run_dir, epochs=1)
    store = CheckpointStore(Storage(run_dir))
    name = store.names()[-1]
    directory = tmp_path / "run" / "checkpoints" / name
    if former_crc32:
        manifest = json.loads((directory / "MANIFEST.json").read_text())
        for file_name in manifest["files"]:
            content = (directory / file_name).read_bytes()
            manifest["files"][file_name] = {"size": len(content), "crc32": zlib.crc32(content)}
        (directory / "MANIFEST.json").write_text(json.dumps(manifest))
    manifest, progress_tree, state = _reader()(str(directory))
    loaded = store.load(name)
    assert manifest["sequence"] == int(name[5:])
    _assert_module_matches(state, loaded)
    assert progress_tree["cursor"] == loaded.progress.cursor.to_dict()


def test_the_documented_reader_refuses_a_damaged_file(tmp_path):
    run_dir = str(tmp_path / "run")
    train_with_checkpoints("tbptt", run_dir, epochs=1)
    directory = tmp_path / "run" / "checkpoints" / CheckpointStore(Storage(run_dir)).names()[-1]
    content = bytearray((directory / "tensors.bin").read_bytes())
    content[-1] ^= 0x80
    (directory / "tensors.bin").write_bytes(bytes(content))
    with pytest.raises(AssertionError, match="tensors.bin"):
        _reader()(str(directory))


@pytest.mark.parametrize("extra, accepted", [("rank-00001.bin", True), ("rank-00001.msgpack", True),
                                             ("notes.txt", False)])
def test_the_documented_reader_takes_rank_files_and_nothing_else(tmp_path, extra, accepted):
    """A distributed checkpoint lists rank-NNNNN files beside the three data files (their
    content is per-rank state; here a stand-in, since only the listing is at stake)."""
    from engine.checkpoint.format.checksum import checksum

    run_dir = str(tmp_path / "run")
    train_with_checkpoints("tbptt", run_dir, epochs=1)
    directory = tmp_path / "run" / "checkpoints" / CheckpointStore(Storage(run_dir)).names()[-1]
    content = b"per-rank state"
    (directory / extra).write_bytes(content)
    manifest = json.loads((directory / "MANIFEST.json").read_text())
    manifest["files"][extra] = {"size": len(content), "crc32c": checksum([content])}
    (directory / "MANIFEST.json").write_text(json.dumps(manifest))
    if accepted:
        assert _reader()(str(directory))[0]["files"][extra]["size"] == len(content)
    else:
        with pytest.raises(AssertionError):
            _reader()(str(directory))
