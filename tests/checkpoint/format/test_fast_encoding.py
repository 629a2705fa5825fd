"""engine.checkpoint.format.codec's fast path (msgpack's C packer walks the tree) against the Python
walk it replaces: the same header bytes and tensors for every kind of tree, and every tree the
fast path cannot encode as the walk does goes to the walk (same bytes, or the same error)."""

from __future__ import annotations

import collections
import enum
import math
import random

import msgpack
import numpy
import pytest
import torch

import engine
from engine.checkpoint.format import codec
from engine.data.rng import capture_global_rng

Pair = collections.namedtuple("Pair", "left right")


class Level(enum.IntEnum):
    HIGH = 3


class Name(str):
    """A str subclass, as torch.__version__ (TorchVersion) in the envelope."""


def _walked_header(tree) -> tuple[bytes, list[torch.Tensor]]:
    """The header as the walk encodes it, with the table built from the documented format."""
    tensors: list[torch.Tensor] = []
    tree_bytes = codec._pack_tree_walked(tree, tensors)
    table, offset = [], 0
    for tensor in tensors:
        table.append({"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                      "offset": offset, "nbytes": tensor.nbytes,
                      "device": "cpu" if tensor.device.type == "cpu" else str(tensor.device)})
        offset = (offset + tensor.nbytes + 63) // 64 * 64
    return msgpack.packb({"format": "splitloop.state", "version": 1, "tensors": table, "tree": tree_bytes}), tensors


def _assert_encoded_as_the_walk_does(tree, fast: bool = True) -> None:
    assert (codec._pack_tree_fast(tree, []) is not None) is fast
    encoded = codec.encode_state(tree)
    header, tensors = _walked_header(tree)
    assert encoded.header == header
    assert len(encoded.tensors) == len(tensors)
    for mine, theirs in zip(encoded.tensors, tensors):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape and mine.is_contiguous()
        assert not mine.requires_grad and not mine.is_conj() and not mine.is_neg()
        assert torch.equal(mine, theirs)


def _trained_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.LSTM(4, 5))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model[0](torch.randn(2, 3)).sum().backward()
    optimizer.step()
    return {"module": model.state_dict(), "optimizers": [optimizer.state_dict()]}


def _every_dtype() -> dict:
    return {name: torch.arange(6).reshape(2, 3).to(dtype) for name, dtype in codec.DTYPES.items()}


TREES = {
    "plain values": {"none": None, "true": True, "false": False, "int": 7, "negative": -3, "float": 2.5,
                     "str": "text", "bytes": b"\x00\xff", "empty list": [], "empty dict": {}},
    "big ints": {"max": 2**64 - 1, "min": -(2**63), "2**63": 2**63, "-2**31": -(2**31)},
    "special floats": {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "-0.0": -0.0, "tiny": 5e-324},
    "nested": {"a": [1, {"b": (2, [3, (4, {"c": None})])}], "d": {"e": {"f": [[], ()]}}},
    "tuples and namedtuples": {"tuple": (1, 2.0, "x"), "empty": (), "pair": Pair(1, Pair(torch.ones(2), (3,)))},
    "top-level list": [1, torch.zeros(2), {"k": (torch.ones(1),)}],
    "top-level tuple": (torch.ones(3), {"x": 1}),
    "keys": {1: "int", -2: "negative", 2.5: "float", True: "bool", None: "none", "": "empty"},
    "every dtype": _every_dtype(),
    "tensor shapes": {"0-dim": torch.tensor(3.5), "empty": torch.zeros(0, 4), "empty int": torch.empty(0, dtype=torch.int64),
                      "transposed": torch.arange(12.0).reshape(3, 4).t(), "strided": torch.arange(10)[::3],
                      "expanded": torch.ones(1, 3).expand(4, 3)},
    "autograd and views": {"parameter": torch.nn.Parameter(torch.randn(2, 2)),
                           "grad": torch.randn(3, requires_grad=True) * 2,
                           "conj": torch.randn(3, dtype=torch.complex64).conj(),
                           "neg view": torch._neg_view(torch.randn(3))},
    "subclasses": {"ordered": collections.OrderedDict(b=1, a=2), "level": Level.HIGH, "float64": numpy.float64(0.25),
                   "name": Name("2.13.0"), "defaultdict": collections.defaultdict(list, x=[1]),
                   "version": torch.__version__},
    "rng": {"rng": capture_global_rng().to_state(), "generator": torch.Generator().manual_seed(5).get_state(),
            "python": random.Random(3).getstate()},
    "trained model": _trained_state(),
    "shared tensor": (lambda shared: {"a": shared, "b": shared, "c": [shared]})(torch.arange(4)),
    "many tensors": {"tensors": [torch.full((2,), float(index)) for index in range(1100)]},
}


@pytest.mark.parametrize("name", list(TREES))
def test_the_fast_path_encodes_the_same_bytes_as_the_walk(name):
    _assert_encoded_as_the_walk_does(TREES[name])


@pytest.mark.parametrize("name", list(TREES))
def test_the_fast_path_round_trips(name):
    tree = TREES[name]
    encoded = codec.encode_state(tree)
    data = bytearray(b"".join(bytes(chunk) for chunk in encoded.tensor_chunks()))
    back = codec.decode_state(encoded.header, data)
    assert codec.encode_state(back).header == encoded.header


def _nested(depth: int):
    tree: object = 1
    for _ in range(depth):
        tree = [tree]
    return tree


class _TensorSubclass(torch.Tensor):
    pass


@pytest.mark.parametrize("tree", [
    {"x": msgpack.ExtType(5, b"payload")},  # msgpack packs it natively; the walk, as the namedtuple it is
    {Level.HIGH: 1},  # a key of a subclass type
    {"t": torch.ones(2).as_subclass(_TensorSubclass)},  # a tensor subclass (a DTensor takes this way)
], ids=["msgpack-ExtType", "int-enum-key", "tensor-subclass"])
def test_trees_the_c_packer_would_store_otherwise_go_to_the_walk(tree):
    _assert_encoded_as_the_walk_does(tree, fast=False)


def test_the_nesting_limit_holds_on_the_fast_path():
    _assert_encoded_as_the_walk_does({"deep": _nested(codec.MAX_NESTING - 1)})
    too_deep = {"deep": _nested(codec.MAX_NESTING)}
    assert codec._pack_tree_fast(too_deep, []) is None
    with pytest.raises(engine.CheckpointWriteError, match=f"nest more than {codec.MAX_NESTING} levels"):
        codec.encode_state(too_deep)
    deeper_than_msgpack = {"deep": _nested(600)}  # past msgpack's own limit too
    with pytest.raises(engine.CheckpointWriteError, match=r"cannot store state\.deep\[0\]"):
        codec.encode_state(deeper_than_msgpack)


@pytest.mark.parametrize("value, message", [
    (bytearray(b"x"), "bytearray"), (memoryview(b"x"), "memoryview"), (msgpack.Timestamp(1, 0), "Timestamp"),
    (2**64, "does not fit in 64 bits"), (-(2**63) - 1, "does not fit in 64 bits"), ({1, 2}, "set"),
    (numpy.int64(3), "int64"), (torch.zeros(2, dtype=torch.uint16), "dtype"), (torch.zeros(2, 2).to_sparse(), "layout"),
], ids=["bytearray", "memoryview", "timestamp", "int-too-big", "int-too-small", "set", "numpy-int64", "uint16", "sparse"])
def test_values_the_fast_path_cannot_store_raise_the_walks_error_naming_the_place(value, message):
    tree = {"optimizers": [{"state": {0: {"step": 1}}}, {"extra": (1, value)}]}
    assert codec._pack_tree_fast(tree, []) is None
    with pytest.raises(engine.CheckpointWriteError, match=message) as caught:
        codec.encode_state(tree)
    assert r"optimizers[1].extra[1]" in str(caught.value)


@pytest.mark.parametrize("key", [b"bytes-key", (1, 2), frozenset()])
def test_keys_the_fast_path_cannot_store_raise_the_walks_error(key):
    tree = {"outer": {"inner": {key: 1}}}
    assert codec._pack_tree_fast(tree, []) is None
    with pytest.raises(engine.CheckpointWriteError, match="cannot store state.outer.inner: dict key"):
        codec.encode_state(tree)


def test_a_structure_change_gives_a_new_table():
    """The header's table is made once per structure: a tensor that appears, changes shape,
    dtype or place in the tree gives the table of the new structure."""
    trees = [
        {"a": torch.zeros(3), "b": 1},
        {"a": torch.zeros(3), "b": torch.zeros(2)},  # a lazily created buffer
        {"a": torch.zeros(4), "b": torch.zeros(2)},  # a shape change
        {"a": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(2)},  # a dtype change
        {"b": torch.zeros(2), "a": torch.zeros(4, dtype=torch.float64)},  # another order
        {"a": torch.zeros(3), "b": 1},  # back to the first
    ]
    for tree in trees:
        _assert_encoded_as_the_walk_does(tree)


def test_layouts_returned_are_not_shared_between_encodings():
    first = codec.encode_state({"a": torch.zeros(3)})
    first.layout.append((999, 1))
    assert codec.encode_state({"a": torch.zeros(3)}).layout == [(0, 12)]


class _GrowingState(engine.Callback):
    """A callback whose state changes shape during the run: a counter, a tuple that grows, and
    a tensor that appears after the third split (a structure change of the checkpoint)."""

    def __init__(self) -> None:
        self.splits = 0

    def on_split_end(self, view: engine.RunView) -> None:
        self.splits += 1

    def state_dict(self) -> dict:
        state: dict = {"splits": self.splits, "history": tuple(range(self.splits % 5))}
        if self.splits >= 3:
            state["tensor"] = torch.full((self.splits,), float(self.splits))
        return state

    def load_state_dict(self, state: dict) -> None:
        self.splits = state["splits"]


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_every_checkpoint_of_a_run_is_encoded_as_the_walk_encodes_it(tmp_path, monkeypatch, writer):
    """Real state trees, through their structure changes (Adam's and SGD momentum's state
    appears at the first step, a callback's tensor later): each checkpoint's header and tensors
    are those of the walk."""
    import engine.checkpoint.policy as policy
    from scenarios import train_with_checkpoints

    encoded_trees = []

    def checked_encode(tree):
        encoded = codec.encode_state(tree)
        header, tensors = _walked_header(tree)
        assert encoded.header == header
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(encoded.tensors, tensors, strict=True))
        encoded_trees.append(len(tensors))
        return encoded

    monkeypatch.setattr(policy, "encode_state", checked_encode)
    train_with_checkpoints("tbptt_several_optimizers", str(tmp_path / "run"), epochs=1, writer=writer,
                           callbacks=(_GrowingState(),))
    assert len(encoded_trees) >= 12 and len(set(encoded_trees)) >= 3  # the structure changed twice


def test_a_branching_reference_cycle_is_refused_as_too_deep():
    """A dict that holds itself twice: the screen goes depth first like the walk, so it meets
    the nesting limit after a hundred steps (breadth first, it would visit 2**100 containers)."""
    looped: dict = {}
    looped["a"] = looped
    looped["b"] = [looped, (looped,)]
    assert codec._pack_tree_fast({"state": looped}, []) is None
    with pytest.raises(engine.CheckpointWriteError, match="reference cycle"):
        codec.encode_state({"state": looped})
