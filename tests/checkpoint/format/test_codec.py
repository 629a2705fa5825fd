"""Unit tests for engine.checkpoint.format.codec: the pickle-free state encoding, including hostile input."""

from __future__ import annotations

import json
import math
import os
import pickle
import shlex
import struct
import zlib

import msgpack
import numpy
import pytest
import torch

import engine
from engine.checkpoint.format import codec
from engine.checkpoint.store.request import CommitRequest
from engine.checkpoint.format.manifest import Manifest, verify_file
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from progress import Cursor, ProgressTree, encode_tree

# ---- helpers -----------------------------------------------------------------------------


def _tensor_data(encoded: codec.EncodedState) -> bytearray:
    return bytearray(b"".join(bytes(chunk) for chunk in encoded.tensor_chunks()))


def _round_trip(tree):
    encoded = codec.encode_state(tree)
    return codec.decode_state(encoded.header, _tensor_data(encoded))


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes in C order, computed without the codec."""
    tensor = tensor.detach().contiguous()
    if tensor.dtype.is_complex:
        tensor = torch.view_as_real(tensor).contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


def _assert_same(expected, actual, where="state"):
    """Structure, exact Python types, and tensors bit for bit."""
    assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, where
        assert actual.shape == expected.shape, where
        assert torch.equal(actual, expected), where
        assert _raw_bytes(actual) == _raw_bytes(expected), where
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert type(key) is type(next(k for k in actual if k == key)), f"{where}: key type of {key!r}"
            _assert_same(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, b) in enumerate(zip(expected, actual)):
            _assert_same(a, b, f"{where}[{index}]")
    elif isinstance(expected, float):
        assert actual == expected and math.copysign(1, actual) == math.copysign(1, expected), where
    else:
        assert actual == expected, where


def _sample(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_complex:
        real_dtype = torch.float32 if dtype == torch.complex64 else torch.float64
        real = torch.randn(shape, generator=generator, dtype=real_dtype)
        imag = torch.randn(shape, generator=generator, dtype=real_dtype)
        return torch.complex(real, imag)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 100).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(low, high, shape, generator=generator, dtype=torch.int64).to(dtype)


def _header(tensors=None, tree=msgpack.packb(None), **overrides) -> bytes:
    """A state header built from the format documented in codec's docstring (not with the codec)."""
    outer = {"format": "splitloop.state", "version": 1, "tensors": [] if tensors is None else tensors, "tree": tree}
    outer.update(overrides)
    return msgpack.packb(outer)


def _tensor_ref(index) -> msgpack.ExtType:
    return msgpack.ExtType(1, msgpack.packb(index))


def _float32_entry(**overrides):
    entry = {"dtype": "float32", "shape": [3], "offset": 0, "nbytes": 12}
    entry.update(overrides)
    return entry


# ---- round trips -------------------------------------------------------------------------


def test_plain_values_round_trip_with_exact_types():
    tree = {
        "none": None, "true": True, "false": False, "zero": 0, "negative": -7, "big": 2**64 - 1,
        "small": -(2**63), "float": 0.1, "negative_zero": -0.0, "inf": float("inf"),
        "text": "héllo", "empty_text": "", "bytes": b"\x00\xffraw", "empty_bytes": b"",
    }
    _assert_same(tree, _round_trip(tree))


def test_nested_containers_round_trip_and_tuples_stay_tuples():
    tree = {
        "list": [1, [2, [3, (4, 5)]], {"inner": (6, [7, (8,)])}],
        "tuple": (1, "a", (2, (3, ())), [None, (True,)]),
        "empty": {"list": [], "tuple": (), "dict": {}},
        "deep": {"a": {"b": {"c": {"d": [({"e": (1.5,)},)]}}}},
    }
    decoded = _round_trip(tree)
    _assert_same(tree, decoded)
    assert isinstance(decoded["tuple"][2][1], tuple)
    assert isinstance(decoded["list"][1][1][1], tuple)


def test_int_and_other_scalar_keys_round_trip():
    tree = {0: "zero", 1: "one", -5: [1], 2**40: {3: (4,)}, "name": {7: None}, 2.5: "float key", None: "none key"}
    _assert_same(tree, _round_trip(tree))


def test_a_tuple_at_the_top_level_round_trips():
    tree = (1, torch.arange(3), [2, ()])
    _assert_same(tree, _round_trip(tree))


@pytest.mark.parametrize("name", sorted(codec.DTYPES))
def test_tensors_of_every_dtype_round_trip(name):
    dtype = codec.DTYPES[name]
    base = _sample(dtype, (3, 5), seed=len(name))
    tree = {
        "matrix": base,
        "transposed": base.t(),  # not contiguous
        "strided": base[:, ::2],  # not contiguous
        "slice": base[1:],  # contiguous, with a storage offset
        "column": base[:, 1],  # 1-D, not contiguous
        "every_other": base[2, ::2],  # 1-D, not contiguous
        "scalar": base[1, 2].clone(),  # 0-dim
        "empty": torch.empty(0, 4, dtype=dtype),
        "empty_1d": torch.empty(0, dtype=dtype),
        "vector": base[0].clone(),
        "high_rank": _sample(dtype, (2, 1, 3, 1, 2), seed=7),
    }
    assert not any(tree[key].is_contiguous() for key in ("transposed", "strided", "column", "every_other"))
    decoded = _round_trip(tree)
    _assert_same(tree, decoded)
    assert decoded["scalar"].dim() == 0
    assert decoded["transposed"].shape == (5, 3)


def test_codec_supports_the_documented_dtypes():
    expected = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
                torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}
    assert set(codec.DTYPES.values()) == expected
    assert {name: str(dtype).removeprefix("torch.") for name, dtype in codec.DTYPES.items()} == {
        name: name for name in codec.DTYPES}


def test_special_float_bit_patterns_survive():
    values = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, 3.4e38])
    decoded = _round_trip({"x": values})["x"]
    assert decoded.dtype == torch.float32
    assert torch.equal(decoded.view(torch.int32), values.view(torch.int32))


def test_tensors_in_parameters_and_with_grad_are_stored_detached():
    parameter = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(3)))
    decoded = _round_trip({"p": parameter, "view": parameter * 1})
    assert type(decoded["p"]) is torch.Tensor
    assert not decoded["p"].requires_grad
    assert torch.equal(decoded["p"], parameter.detach())
    assert torch.equal(decoded["view"], parameter.detach())


def test_many_tensors_and_mixed_tree():
    tensors = [_sample(dtype, (i + 1, 2), seed=i) for i, dtype in enumerate(codec.DTYPES.values())]
    tree = {"tensors": tensors, "paired": tuple(zip(range(len(tensors)), tensors)), "state": {0: {"step": 3, "buf": tensors[0]}}}
    _assert_same(tree, _round_trip(tree))


def test_module_and_optimizer_state_dicts_round_trip():
    torch.manual_seed(0)
    model = torch.nn.LSTM(3, 4, batch_first=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    output, _ = model(torch.randn(2, 5, 3))
    output.pow(2).mean().backward()
    optimizer.step()
    tree = {"module": model.state_dict(), "optimizer": optimizer.state_dict()}
    decoded = _round_trip(tree)
    _assert_same(dict(tree["module"]), dict(decoded["module"]))
    _assert_same(tree["optimizer"], decoded["optimizer"])


def test_tensor_bytes_are_raw_little_endian_at_aligned_offsets():
    first = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float32)
    second = torch.tensor([7, -8], dtype=torch.int16)
    encoded = codec.encode_state({"a": first, "b": second})
    data = _tensor_data(encoded)
    outer = msgpack.unpackb(encoded.header, raw=False)
    assert outer["format"] == "splitloop.state" and outer["version"] == 1
    entries = outer["tensors"]
    assert [entry["dtype"] for entry in entries] == ["float32", "int16"]
    assert [entry["shape"] for entry in entries] == [[3], [2]]
    assert [entry["nbytes"] for entry in entries] == [12, 4]
    assert all(entry["offset"] % 64 == 0 for entry in entries)
    a, b = entries
    assert bytes(data[a["offset"]:a["offset"] + 12]) == struct.pack("<3f", 1.5, -2.0, 3.25)
    assert bytes(data[b["offset"]:b["offset"] + 4]) == struct.pack("<2h", 7, -8)


def test_hand_built_state_decodes():
    # Control for the hostile tests: a header written by hand from the documented format decodes.
    data = bytearray(struct.pack("<3f", 1.0, 2.0, 4.0))
    tree = msgpack.packb({"w": _tensor_ref(0), "pair": msgpack.ExtType(2, msgpack.packb([1, _tensor_ref(0)]))})
    state = codec.decode_state(_header([_float32_entry()], tree), data)
    assert torch.equal(state["w"], torch.tensor([1.0, 2.0, 4.0]))
    assert type(state["pair"]) is tuple and state["pair"][0] == 1
    assert torch.equal(state["pair"][1], torch.tensor([1.0, 2.0, 4.0]))


def test_conjugate_view_of_a_complex_tensor_round_trips():
    tensor = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    decoded = _round_trip({"c": tensor.conj()})["c"]
    assert torch.equal(decoded, torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64))


# ---- unsupported values ------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, type_name",
    [(object(), "object"), ({1, 2}, "set"), (frozenset(), "frozenset"), (numpy.int64(3), "int64"),
     (numpy.zeros(2), "ndarray"), (bytearray(b"x"), "bytearray"), (lambda: 0, "function"),
     (torch.nn.Linear(1, 1), "Linear"), (2**64, "int"), (-(2**63) - 1, "int")],
    ids=["object", "set", "frozenset", "numpy-int64", "ndarray", "bytearray", "function", "module", "int-too-big",
         "int-too-small"],
)
def test_unsupported_values_raise_write_error_naming_the_path(value, type_name):
    tree = {"optimizers": [0, {"extra": value}]}
    with pytest.raises(engine.CheckpointWriteError) as caught:
        codec.encode_state(tree)
    message = str(caught.value)
    assert "optimizers[1].extra" in message
    assert type_name in message


def test_unsupported_value_inside_a_tuple_names_its_index():
    with pytest.raises(engine.CheckpointWriteError, match=r"rng\[2\]"):
        codec.encode_state({"rng": (1, 2, object())})


@pytest.mark.parametrize("key", [(1, 2), b"bytes-key", frozenset()])
def test_unsupported_dict_keys_raise_write_error(key):
    with pytest.raises(engine.CheckpointWriteError, match="key"):
        codec.encode_state({"outer": {key: 1}})


def test_unsupported_tensor_dtype_and_layout_raise_write_error():
    with pytest.raises(engine.CheckpointWriteError, match="uint16|dtype"):
        codec.encode_state({"t": torch.zeros(2, dtype=torch.uint16)})
    with pytest.raises(engine.CheckpointWriteError, match="layout"):
        codec.encode_state({"t": torch.zeros(3, 3).to_sparse()})


# ---- hostile input -----------------------------------------------------------------------


class _Exploit:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def test_exploit_payload_is_live(tmp_path):
    # Control: the payload used below really runs code when given to pickle.
    marker = tmp_path / "control-marker"
    pickle.loads(pickle.dumps(_Exploit(marker)))
    assert marker.exists()


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_pickle_payload_as_header_is_refused_without_running_it(tmp_path, protocol):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Exploit(marker), protocol=protocol)
    with pytest.raises(engine.CheckpointCorrupt):
        codec.decode_state(payload, bytearray(64))
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [0, pickle.HIGHEST_PROTOCOL])
def test_pickle_payload_as_tree_is_refused_without_running_it(tmp_path, protocol):
    marker = tmp_path / "pwned"
    header = _header(tree=pickle.dumps(_Exploit(marker), protocol=protocol))
    with pytest.raises(engine.CheckpointCorrupt):
        codec.decode_state(header, bytearray())
    assert not marker.exists()


@pytest.mark.parametrize("code", [3, 42, 0, 127])
@pytest.mark.parametrize("where", ["outer-value", "outer-top", "tree-value", "tree-in-tuple", "tensor-ref-payload",
                                   "tensor-entry"])
def test_unknown_extension_types_are_refused(code, where):
    ext = msgpack.ExtType(code, b"\x01\x02")
    data = bytearray(struct.pack("<3f", 1.0, 2.0, 3.0))
    entries = [_float32_entry()]
    if where == "outer-value":
        header = _header(entries, msgpack.packb(None), format=ext)
    elif where == "outer-top":
        header = msgpack.packb(ext)
    elif where == "tree-value":
        header = _header(entries, msgpack.packb({"a": [1, ext]}))
    elif where == "tree-in-tuple":
        header = _header(entries, msgpack.packb({"a": msgpack.ExtType(2, msgpack.packb([1, ext]))}))
    elif where == "tensor-ref-payload":
        header = _header(entries, msgpack.packb({"a": msgpack.ExtType(1, msgpack.packb(ext))}))
    else:
        header = _header([_float32_entry(shape=[ext])], msgpack.packb(None))
    with pytest.raises(engine.CheckpointCorrupt):
        codec.decode_state(header, data)


@pytest.mark.parametrize("ext", [b"\xd4\xfb\x00", b"\xd4\x80\x00", b"\xc7\x00\x03"],
                         ids=["code-minus-5", "code-minus-128", "code-3-empty"])
def test_raw_extension_bytes_with_other_codes_are_refused(ext):
    # Negative codes cannot be built with msgpack.ExtType; write the bytes by hand.
    tree = b"\x81\xa1a" + ext  # {"a": <ext>}
    with pytest.raises(engine.CheckpointCorrupt):
        codec.decode_state(_header(tree=tree), bytearray())


@pytest.mark.parametrize("where", ["tree", "tuple"])
def test_timestamp_extension_is_refused(where):
    timestamp = msgpack.Timestamp(seconds=5)
    value = timestamp if where == "tree" else msgpack.ExtType(2, msgpack.packb([timestamp]))
    with pytest.raises(engine.CheckpointCorrupt):
        codec.decode_state(_header(tree=msgpack.packb({"metrics_bytes": value})), bytearray())


@pytest.mark.parametrize(
    "entry, data_size",
    [
        (_float32_entry(offset=64), 64),  # starts past the end
        (_float32_entry(offset=60), 64),  # straddles the end
        (_float32_entry(offset=0), 8),  # data truncated
        (_float32_entry(offset=2**61, nbytes=12), 64),
        ({"dtype": "float32", "shape": [2**20], "offset": 0, "nbytes": 4 * 2**20}, 64),
    ],
    ids=["past-end", "straddles-end", "truncated", "huge-offset", "large-tensor-small-file"],
)
def test_tensor_outside_the_data_is_refused(entry, data_size):
    with pytest.raises(engine.CheckpointCorrupt, match="outside"):
        codec.decode_state(_header([entry], msgpack.packb(_tensor_ref(0))), bytearray(data_size))


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "float32", "shape": [2**40, 2**40], "offset": 0, "nbytes": 16},
        {"dtype": "uint8", "shape": [2**41], "offset": 0, "nbytes": 2**41},
        {"dtype": "float32", "shape": [3], "offset": 0, "nbytes": 8},  # nbytes mismatch
        {"dtype": "float32", "shape": [3], "offset": 0, "nbytes": 16},  # nbytes mismatch
        {"dtype": "float32", "shape": [-1, 3], "offset": 0, "nbytes": 12},
        {"dtype": "float32", "shape": [3, -4], "offset": 0, "nbytes": 12},
        {"dtype": "float32", "shape": [1.5], "offset": 0, "nbytes": 4},
        {"dtype": "float32", "shape": [True], "offset": 0, "nbytes": 4},
        {"dtype": "float32", "shape": "3", "offset": 0, "nbytes": 12},
        {"dtype": "float32", "shape": [1] * 65, "offset": 0, "nbytes": 4},
        {"dtype": "object", "shape": [1], "offset": 0, "nbytes": 8},
        {"dtype": "torch.float32", "shape": [1], "offset": 0, "nbytes": 4},
        {"dtype": 6, "shape": [1], "offset": 0, "nbytes": 4},
        {"dtype": None, "shape": [1], "offset": 0, "nbytes": 4},
        {"dtype": "float32", "shape": [1], "offset": -64, "nbytes": 4},
        {"dtype": "float32", "shape": [1], "offset": True, "nbytes": 4},
        {"dtype": "float32", "shape": [1], "offset": 0, "nbytes": -4},
        {"dtype": "float32", "shape": [1], "offset": 0.0, "nbytes": 4},
        {"dtype": "float32", "shape": [1], "offset": 0},
        {"dtype": "float32", "shape": [1], "offset": 0, "nbytes": 4, "pickle": b"x"},
        ["float32", [1], 0, 4],
        "float32",
    ],
    ids=["2**40x2**40", "2**41-bytes", "nbytes-short", "nbytes-long", "negative-dim", "negative-dim-2", "float-dim",
         "bool-dim", "shape-not-list", "65-dims", "dtype-object", "dtype-torch-name", "dtype-int", "dtype-none",
         "negative-offset", "bool-offset", "negative-nbytes", "float-offset", "missing-nbytes", "extra-key",
         "entry-list", "entry-str"],
)
def test_absurd_or_malformed_tensor_entries_are_refused(entry):
    with pytest.raises(engine.CheckpointCorrupt, match="tensor 0"):
        codec.decode_state(_header([entry], msgpack.packb(_tensor_ref(0))), bytearray(128))


@pytest.mark.parametrize("index", [1, 5, -1, 2**40, True, "0", None, 0.0])
def test_tensor_reference_out_of_range_or_not_an_index_is_refused(index):
    data = bytearray(struct.pack("<3f", 1.0, 2.0, 3.0))
    with pytest.raises(engine.CheckpointCorrupt, match="tensor"):
        codec.decode_state(_header([_float32_entry()], msgpack.packb({"w": _tensor_ref(index)})), data)


def test_tensor_reference_with_an_empty_table_is_refused():
    with pytest.raises(engine.CheckpointCorrupt):
        codec.decode_state(_header([], msgpack.packb([_tensor_ref(0)])), bytearray(64))


@pytest.mark.parametrize("payload", [msgpack.packb({"a": 1}), msgpack.packb(3), b"\xc1", b""])
def test_tuple_payload_that_is_not_an_array_is_refused(payload):
    with pytest.raises(engine.CheckpointCorrupt):
        codec.decode_state(_header(tree=msgpack.packb(msgpack.ExtType(2, payload))), bytearray())


@pytest.mark.parametrize(
    "header",
    [
        _header(format="splitloop.progress"),
        _header(format="splitloop.state.v2"),
        _header(format=None),
        _header(version=2),
        _header(version=0),
        _header(version="1"),
        msgpack.packb({"format": "splitloop.state", "version": 1, "tensors": []}),
        msgpack.packb({"format": "splitloop.state", "tensors": [], "tree": msgpack.packb(None)}),
        _header(pickle=b"\x80\x04"),
        _header(tensors={}),
        _header(tree="not bytes"),
        _header(tree=None),
        msgpack.packb(["splitloop.state", 1, [], b"\xc0"]),
        msgpack.packb(None),
        msgpack.packb(b"splitloop.state"),
        b"",
        b"\xc1",
        _header()[:-3],
        _header() + b"\x00",
        json.dumps({"format": "splitloop.state", "version": 1, "tensors": [], "tree": ""}).encode(),
    ],
    ids=["format-progress", "format-v2", "format-none", "version-2", "version-0", "version-str", "missing-tree",
         "missing-version", "extra-key", "tensors-dict", "tree-str", "tree-none", "array", "nil", "bytes", "empty",
         "reserved-byte", "truncated", "trailing", "json"],
)
def test_wrong_format_version_or_keys_are_refused(header):
    with pytest.raises(engine.CheckpointCorrupt):
        codec.decode_state(header, bytearray(64))


def test_hand_built_header_with_defaults_decodes():
    # Control for the parametrized test above: the untouched hand-built header is valid.
    assert codec.decode_state(_header(), bytearray(64)) is None


def test_boolean_version_is_refused():
    with pytest.raises(engine.CheckpointCorrupt):
        codec.decode_state(_header(version=True), bytearray())


# ---- a hostile file inside a real checkpoint directory -----------------------------------


def _write_checkpoint(store: CheckpointStore, weight: torch.Tensor) -> str:
    encoded = codec.encode_state({"weight": weight, "step": 3})
    tree = ProgressTree(cursor=Cursor(0, 1, 2, 0))
    return store.write(CommitRequest.of_state(encoded, encode_tree(tree), tree.cursor, generation=0))


def _replace_file_and_fix_manifest(directory, file_name: str, content: bytes) -> None:
    (directory / file_name).write_bytes(content)
    manifest_path = directory / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][file_name] = {"size": len(content), "crc32": zlib.crc32(content)}
    manifest_path.write_text(json.dumps(manifest))


def test_pickle_state_file_in_a_verified_checkpoint_is_refused_without_running_it(tmp_path):
    run_dir = tmp_path / "run"
    marker = tmp_path / "pwned"
    store = CheckpointStore(Storage(str(run_dir)))
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    name = _write_checkpoint(store, weight)
    loaded = store.load(name)  # control: the untouched checkpoint loads
    assert torch.equal(loaded.state["weight"], weight) and loaded.state["step"] == 3

    directory = run_dir / "checkpoints" / name
    payload = pickle.dumps(_Exploit(marker), protocol=pickle.HIGHEST_PROTOCOL)
    _replace_file_and_fix_manifest(directory, "state.msgpack", payload)
    manifest = Manifest.from_json((directory / "MANIFEST.json").read_bytes())
    verify_file("state.msgpack", payload, manifest.files["state.msgpack"])  # passes verification

    with pytest.raises(engine.CheckpointCorrupt) as caught:
        store.load(name)
    assert "CRC" not in str(caught.value)
    assert not marker.exists()


def test_latest_skips_a_hostile_newest_checkpoint_and_uses_the_previous_one(tmp_path):
    run_dir = tmp_path / "run"
    marker = tmp_path / "pwned"
    store = CheckpointStore(Storage(str(run_dir)))
    good_weight = torch.full((2, 2), 7.0)
    good = _write_checkpoint(store, good_weight)
    newest = _write_checkpoint(store, torch.zeros(2, 2))
    assert newest != good
    payload = pickle.dumps(_Exploit(marker), protocol=0)
    _replace_file_and_fix_manifest(run_dir / "checkpoints" / newest, "state.msgpack", payload)
    with pytest.warns(UserWarning, match=newest):
        loaded = store.latest()
    assert loaded is not None and loaded.name == good
    assert torch.equal(loaded.state["weight"], good_weight)
    assert not marker.exists()


def test_subclasses_of_the_plain_types_are_stored_as_their_base_type():
    """The encoder dispatches on exact types first; subclasses take the general path and come
    back as the plain type (an OrderedDict as a dict, an IntEnum as an int, ...)."""
    import collections
    import enum

    class Level(enum.IntEnum):
        HIGH = 3

    Pair = collections.namedtuple("Pair", "left right")
    weight = torch.nn.Parameter(torch.randn(2, 3))
    tree = {"ordered": collections.OrderedDict(a=1, b=2.5), "level": Level.HIGH, "float64": numpy.float64(0.25),
            "parameter": weight, "pair": Pair(1, torch.arange(3)), True: None, None: "none", 7: [1.5]}
    back = _round_trip(tree)
    assert type(back["ordered"]) is dict and back["ordered"] == {"a": 1, "b": 2.5}
    assert type(back["level"]) is int and back["level"] == 3
    assert type(back["float64"]) is float and back["float64"] == 0.25
    assert type(back["parameter"]) is torch.Tensor and torch.equal(back["parameter"], weight.detach())
    assert back["pair"].left == 1 and torch.equal(back["pair"].right, torch.arange(3))
    assert back[True] is None and back[None] == "none" and back[7] == [1.5]
