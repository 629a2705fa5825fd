"""Malformed state and manifest files that used to escape as raw Python errors (or crash the
process): each is CheckpointCorrupt, reported INVALID by ``inspect`` and skipped on resume.
The nesting limit holds on both sides, so the engine never writes a state it cannot read."""

import collections
import json
import re
import sys
import zlib

import fsspec
import msgpack
import pytest
import torch

import engine
from engine.checkpoint.format import codec
from engine.checkpoint.format.manifest import Manifest
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from engine.cli.commands import inspect_run
import forkserver
from resume_helpers import assert_same_run, copy_run_until
from scenarios import train_with_checkpoints

CRASHING_TUPLE_DEPTH = 300  # tuples this deep crashed the reader with SIGSEGV


def _nested(depth, wrap):
    value = 1
    for _ in range(depth):
        value = wrap(value)
    return value


def _round_trip(tree):
    encoded = codec.encode_state(tree)
    data = bytearray(b"".join(bytes(chunk) for chunk in encoded.tensor_chunks()))
    return codec.decode_state(encoded.header, data)


def _header(tree_node, tensors=()):
    """A state.msgpack built by hand, as a hostile writer would."""
    return msgpack.packb({"format": codec.FORMAT, "version": codec.VERSION, "tensors": list(tensors),
                          "tree": msgpack.packb(tree_node)})


def _hand_built_tuples(depth):
    """Tuples nested ``depth`` deep, encoded directly (the engine's writer refuses them)."""
    node = msgpack.ExtType(2, msgpack.packb([1]))
    for _ in range(depth - 1):
        node = msgpack.ExtType(2, msgpack.packb([node]))
    return node


# ---- the writer ---------------------------------------------------------------------------


Pair = collections.namedtuple("Pair", "left right")

WRAPPERS = {
    "tuple": lambda value: (value,),
    "list": lambda value: [value],
    "dict": lambda value: {"inner": value},
    "namedtuple": lambda value: Pair(value, 0),
}


@pytest.mark.parametrize("kind", sorted(WRAPPERS))
def test_the_writer_refuses_nesting_past_the_limit_with_a_clear_error(kind):
    too_deep = _nested(codec.MAX_NESTING + 1, WRAPPERS[kind])
    with pytest.raises(engine.CheckpointWriteError, match=f"nest more than {codec.MAX_NESTING} levels"):
        codec.encode_state(too_deep)


@pytest.mark.parametrize("kind", sorted(WRAPPERS))
def test_what_the_writer_accepts_at_the_limit_reads_back(kind):
    deepest = _nested(codec.MAX_NESTING, WRAPPERS[kind])
    assert _round_trip(deepest) == deepest


def test_a_reference_cycle_is_a_write_error_not_a_recursion_error():
    cycle = {"a": []}
    cycle["a"].append(cycle)
    with pytest.raises(engine.CheckpointWriteError, match="reference cycle"):
        codec.encode_state(cycle)


# ---- the reader ---------------------------------------------------------------------------


def test_the_reader_refuses_tuples_one_level_past_the_limit():
    assert codec.decode_state(_header(_hand_built_tuples(codec.MAX_NESTING)), bytearray()) is not None
    with pytest.raises(engine.CheckpointCorrupt, match=f"nest more than {codec.MAX_NESTING} levels"):
        codec.decode_state(_header(_hand_built_tuples(codec.MAX_NESTING + 1)), bytearray())


@pytest.mark.parametrize("depth", [codec.MAX_NESTING + 1, 100_000])
def test_the_reader_refuses_deeply_nested_lists(depth):
    tree = b"\x91" * depth + b"\x01"  # msgpack: `depth` one-element arrays around the int 1
    header = msgpack.packb({"format": codec.FORMAT, "version": codec.VERSION, "tensors": [], "tree": tree})
    with pytest.raises(engine.CheckpointCorrupt):
        codec.decode_state(header, bytearray())


def test_a_huge_shape_with_a_zero_dimension_is_corrupt_not_a_runtime_error():
    entry = {"dtype": "float32", "shape": [0, 2 ** 61, 2 ** 61], "offset": 0, "nbytes": 0}
    header = _header(msgpack.ExtType(1, msgpack.packb(0)), [entry])
    with pytest.raises(engine.CheckpointCorrupt, match="larger than any real tensor"):
        codec.decode_state(header, bytearray())


# ---- hostile files inside a real run: inspect reports them, resume skips them --------------


def _replace_state(fs, directory, header):
    fs.pipe_file(f"{directory}/state.msgpack", header)
    path = f"{directory}/MANIFEST.json"
    manifest = json.loads(fs.cat_file(path))
    manifest["files"]["state.msgpack"] = {"size": len(header), "crc32": zlib.crc32(header)}
    fs.pipe_file(path, json.dumps(manifest).encode())


def damage_deep_tuples(fs, directory):
    _replace_state(fs, directory, _header(_hand_built_tuples(CRASHING_TUPLE_DEPTH)))


def damage_huge_shape(fs, directory):
    entry = {"dtype": "float32", "shape": [0, 2 ** 61, 2 ** 61], "offset": 0, "nbytes": 0}
    _replace_state(fs, directory, _header({"weight": msgpack.ExtType(1, msgpack.packb(0))}, [entry]))


def _edit_manifest_text(fs, directory, pattern, replacement):
    path = f"{directory}/MANIFEST.json"
    text, count = re.subn(pattern, replacement, fs.cat_file(path).decode(), count=1)
    assert count == 1
    fs.pipe_file(path, text.encode())


def damage_infinite_generation(fs, directory):
    _edit_manifest_text(fs, directory, r'"writer_generation": ?\d+', '"writer_generation": 1e999')


def damage_deeply_nested_json(fs, directory):
    depth = 100_000
    _edit_manifest_text(fs, directory, r'"cursor": ?\{[^}]*\}', '"cursor": ' + "[" * depth + "]" * depth)


DAMAGES = {
    "deep tuples": (damage_deep_tuples, "tuples nest more than"),
    "huge shape": (damage_huge_shape, "larger than any real tensor"),
    "infinite writer_generation": (damage_infinite_generation, "writer_generation"),
    "deeply nested JSON": (damage_deeply_nested_json, "MANIFEST.json"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_with_checkpoints("tbptt", run_dir, every=4, keep_last=None)
    return run_dir


def _damaged_copy(reference, run_dir, damage):
    names = CheckpointStore(Storage(reference)).names()
    newest, previous = names[3], names[2]
    copy_run_until(reference, run_dir, newest)
    fs, root = fsspec.core.url_to_fs(run_dir)
    damage(fs, f"{root}/checkpoints/{newest}")
    return newest, previous


def test_the_infinite_generation_damage_is_what_it_says(reference, tmp_path):
    newest, _ = _damaged_copy(reference, str(tmp_path / "run"), damage_infinite_generation)
    raw = (tmp_path / "run" / "checkpoints" / newest / "MANIFEST.json").read_bytes()
    assert json.loads(raw)["writer_generation"] == float("inf")
    with pytest.raises(engine.CheckpointCorrupt, match="writer_generation"):
        Manifest.from_json(raw)


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_malformed_newest_checkpoint_is_invalid_and_resume_falls_back(damage, reference, tmp_path):
    damage_function, message = DAMAGES[damage]
    run_dir = str(tmp_path / "run")
    newest, previous = _damaged_copy(reference, run_dir, damage_function)

    report = inspect_run(run_dir)
    entry = next(e for e in report["checkpoints"] if e["name"] == newest)
    assert entry["valid"] is False and message in entry["error"]
    assert report["latest"] == previous

    with pytest.warns(UserWarning, match=f"skipping checkpoint {newest}"):
        result = train_with_checkpoints("tbptt", run_dir, every=4, keep_last=None)
    assert result.resumed_from == previous
    assert_same_run(reference, run_dir)


@pytest.mark.slow
def test_inspect_in_a_real_process_reports_deep_tuples_instead_of_crashing(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    newest, previous = _damaged_copy(reference, run_dir, damage_deep_tuples)
    process = forkserver.run([sys.executable, "-m", "engine", "inspect", run_dir, "--json"],
                             capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, (process.returncode, process.stderr[-2000:])
    report = json.loads(process.stdout)
    entry = next(e for e in report["checkpoints"] if e["name"] == newest)
    assert entry["valid"] is False and "tuples nest more than" in entry["error"]
    assert report["latest"] == previous
