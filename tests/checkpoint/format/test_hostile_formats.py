"""Hand-crafted manifests and state headers that used to load: each is now CheckpointCorrupt
with a message naming what is wrong (docs/checkpoint-format.md, "What a reader refuses")."""

import json

import msgpack
import pytest
import torch

import engine
from engine.checkpoint.format import codec
from engine.checkpoint.format.manifest import Manifest

MANIFEST = {
    "format": "splitloop.checkpoint", "version": 1, "sequence": 8, "writer_generation": 1,
    "created_unix": 1.0, "cursor": {"epoch": 0, "batch": 1, "split": 3, "optimizer": 0},
    "files": {name: {"size": 1, "crc32c": 0} for name in ("tensors.bin", "state.msgpack", "progress.msgpack")},
}


def test_the_manifest_used_below_parses():
    assert Manifest.from_json(json.dumps(MANIFEST).encode()).sequence == 8


def test_a_manifest_key_given_twice_is_corrupt():
    # json keeps the last of two equal keys, other readers the first: one file, two checkpoints.
    raw = json.dumps(MANIFEST)[:-1] + ', "sequence": 9}'
    with pytest.raises(engine.CheckpointCorrupt, match="'sequence' appears twice"):
        Manifest.from_json(raw.encode())


def test_a_file_record_key_given_twice_is_corrupt():
    raw = json.dumps(MANIFEST).replace('"size": 1,', '"size": 1, "size": 2,', 1)
    with pytest.raises(engine.CheckpointCorrupt, match="'size' appears twice"):
        Manifest.from_json(raw.encode())


@pytest.mark.parametrize("version", [True, 1.0])
def test_a_manifest_version_that_only_compares_equal_to_1_is_corrupt(version):
    with pytest.raises(engine.CheckpointCorrupt, match="version"):
        Manifest.from_json(json.dumps({**MANIFEST, "version": version}).encode())


# ---- state.msgpack ------------------------------------------------------------------------


def _header(entries, tree):
    """A state header written by hand from the format in codec's docstring."""
    return msgpack.packb({"format": "splitloop.state", "version": 1, "tensors": entries, "tree": msgpack.packb(tree)})


def _reference(index):
    return msgpack.ExtType(1, msgpack.packb(index))


def _entry(offset, count=4, **overrides):
    return {"dtype": "float32", "shape": [count], "offset": offset, "nbytes": 4 * count, "device": "cpu", **overrides}


TWO_TENSORS = {"a": _reference(0), "b": _reference(1)}


def test_two_tensors_laid_out_apart_load():
    state = codec.decode_state(_header([_entry(0), _entry(64)], TWO_TENSORS), bytearray(128))
    assert torch.equal(state["a"], torch.zeros(4)) and torch.equal(state["b"], torch.zeros(4))


@pytest.mark.parametrize("second_offset", [0, 64], ids=["same bytes", "overlapping tail"])
def test_tensors_sharing_bytes_are_corrupt(second_offset):
    # Loaded, they would share memory: an in-place update of one (an optimizer's moment, say)
    # would silently change the other.
    entries = [_entry(0, count=32), _entry(second_offset)]
    with pytest.raises(engine.CheckpointCorrupt, match="overlapping"):
        codec.decode_state(_header(entries, TWO_TENSORS), bytearray(256))


def test_empty_tensors_at_one_offset_do_not_overlap():
    entries = [_entry(0, count=0), _entry(0, count=0)]
    state = codec.decode_state(_header(entries, TWO_TENSORS), bytearray())
    assert state["a"].shape == (0,) and state["b"].shape == (0,)


@pytest.mark.parametrize("offset", [1, 4, 32])
def test_an_offset_off_the_64_byte_grid_is_corrupt(offset):
    with pytest.raises(engine.CheckpointCorrupt, match=f"offset {offset} is not a multiple of 64"):
        codec.decode_state(_header([_entry(offset)], {"a": _reference(0)}), bytearray(128))


@pytest.mark.parametrize("device", [{"type": "cuda"}, 0, None])
def test_a_device_that_is_not_a_name_is_corrupt(device):
    with pytest.raises(engine.CheckpointCorrupt, match="is not a device name"):
        codec.decode_state(_header([_entry(0, device=device)], {"a": _reference(0)}), bytearray(64))


KEYS = {
    "tensor": _reference(0),
    "tuple": msgpack.ExtType(2, msgpack.packb([1, 2])),
    "bytes": b"weight",
}


@pytest.mark.parametrize("kind", sorted(KEYS))
@pytest.mark.parametrize("where", ["top level", "nested"])
def test_a_map_key_the_writer_never_stores_is_corrupt(kind, where):
    tree = {KEYS[kind]: 1}
    if where == "nested":
        tree = {"callbacks": [{"inner": tree}]}
    with pytest.raises(engine.CheckpointCorrupt, match=f"map key of type {'Tensor' if kind == 'tensor' else kind}"):
        codec.decode_state(_header([_entry(0)], tree), bytearray(64))


def test_every_key_type_the_writer_stores_reads_back():
    tree = {"name": 1, 7: 2, 0.5: 3, True: 4, None: 5}
    encoded = codec.encode_state(tree)
    assert codec.decode_state(encoded.header, bytearray()) == tree
