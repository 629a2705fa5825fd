"""The encoded structure remembered from one checkpoint to the next (engine.checkpoint.format.codec:
each entry of the state tree is screened again only when its bytes or its hooked types change;
the tensor table and the snapshot buffer's layout are made once per structure). A remembered
structure must never go stale: a scalar that changes, a new optimizer state entry, a dtype or
shape change, a value the walk refuses in place of one it takes. Every checkpoint stays exact."""

from __future__ import annotations

import copy

import msgpack
import pytest
import torch

import engine
from engine.checkpoint.format import codec
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.writers.buffers import SnapshotBuffers


def _walked(tree) -> tuple[bytes, list[torch.Tensor]]:
    """The header and tensors as the reference walk encodes ``tree`` (no remembered structure)."""
    tensors: list[torch.Tensor] = []
    tree_bytes = codec._pack_tree_walked(tree, tensors)
    table = codec._table.__wrapped__(codec._structure(tensors))
    return table[0] + msgpack.packb(tree_bytes), tensors


def _assert_exact(tree) -> codec.EncodedState:
    """``tree`` encodes as the walk encodes it, and reads back equal, tensor for tensor."""
    encoded = codec.encode_state(tree)
    header, tensors = _walked(tree)
    assert encoded.header == header
    assert len(encoded.tensors) == len(tensors)
    for mine, theirs in zip(encoded.tensors, tensors):
        assert (mine.dtype, mine.shape) == (theirs.dtype, theirs.shape) and torch.equal(mine, theirs)
    data = bytearray(b"".join(bytes(chunk) for chunk in encoded.tensor_chunks()))
    _assert_same(codec.decode_state(encoded.header, data), tree)
    return encoded


def _assert_same(read, written, path="state") -> None:
    if isinstance(written, torch.Tensor):
        assert isinstance(read, torch.Tensor) and read.dtype == written.dtype and read.shape == written.shape, path
        assert torch.equal(read, written.detach()), path
    elif isinstance(written, dict):
        assert isinstance(read, dict) and list(read) == list(written), path
        for key in written:
            _assert_same(read[key], written[key], f"{path}.{key}")
    elif isinstance(written, (list, tuple)):
        assert type(read) is type(written) or isinstance(written, tuple) and isinstance(read, tuple), path
        assert len(read) == len(written), path
        for index, (mine, theirs) in enumerate(zip(read, written)):
            _assert_same(mine, theirs, f"{path}[{index}]")
    else:  # a subclass of a plain type (torch's version string) reads back as its base type
        base = next(kind for kind in (bool, int, float, str, bytes, type(None)) if isinstance(written, kind))
        assert type(read) is base and read == written, path


def _state(lr: float = 0.1) -> dict:
    weight = torch.arange(6.0).reshape(2, 3)
    return {
        "module": {"weight": weight, "bias": torch.zeros(2)},
        "optimizers": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 3)}},
                        "param_groups": [{"lr": lr, "betas": (0.9, 0.999), "params": [0, 1]}]}],
        "loops": {"position": 4, "flags": [True, False]},
        "callbacks": {"blob": b"state bytes"},
        "elapsed_seconds": 1.5,
    }


def test_every_change_after_a_remembered_structure_encodes_as_the_walk():
    """A sequence of states, each encoded after the one before (which is then remembered):
    each change must show in its checkpoint, exactly."""
    state = _state()
    _assert_exact(state)
    _assert_exact(state)  # the same structure again: remembered, still the walk's bytes

    state["optimizers"][0]["param_groups"][0]["lr"] = 0.05  # a scalar changes
    state["loops"]["position"] = 5
    state["elapsed_seconds"] = 2.5
    _assert_exact(state)

    state["module"]["weight"].add_(1.0)  # tensor values change in place: the same structure
    _assert_exact(state)

    state["optimizers"][0]["state"][0]["exp_avg_sq"] = torch.full((2, 3), 0.5)  # a new optimizer state entry
    _assert_exact(state)

    state["module"]["weight"] = state["module"]["weight"].view(torch.int32)  # a dtype change, same bytes
    _assert_exact(state)

    state["module"]["weight"] = state["module"]["weight"].view(torch.float32).reshape(3, 2)  # a shape change
    _assert_exact(state)

    state["module"]["bias"] = torch.nn.Parameter(torch.zeros(2))  # a Parameter where a tensor was: same bytes
    _assert_exact(state)

    state["optimizers"][0]["param_groups"][0]["betas"] = [0.9, 0.999]  # a tuple becomes a list
    _assert_exact(state)


def test_an_extension_type_in_place_of_a_remembered_tuple_goes_to_the_walk():
    """msgpack's own ExtType packs to the very bytes of the tuple it replaces, which the
    remembered structure holds: only the hook's types tell them apart, and the walk stores it
    otherwise (as the namedtuple it is)."""
    state = _state()
    _assert_exact(state)
    _assert_exact(state)
    betas = state["optimizers"][0]["param_groups"][0]["betas"]
    state["optimizers"][0]["param_groups"][0]["betas"] = msgpack.ExtType(2, msgpack.packb(list(betas)))
    assert codec._pack_tree_fast(state, []) is None
    _assert_exact(state)


@pytest.mark.parametrize("kind", [bytearray, memoryview])
def test_a_value_the_walk_refuses_in_place_of_remembered_bytes_is_refused(kind):
    """A bytearray packs to the bytes of the ``bytes`` it replaces; an entry holding bytes is
    never remembered, so the screen sees the bytearray and the walk refuses it."""
    state = _state()
    _assert_exact(state)
    _assert_exact(state)
    state["callbacks"]["blob"] = kind(b"state bytes")
    with pytest.raises(engine.CheckpointWriteError, match=f"callbacks.blob: values of type {kind.__name__}"):
        codec.encode_state(state)


def test_a_tensor_key_in_a_remembered_entry_is_refused():
    state = _state()
    _assert_exact(state)
    state["loops"] = {"position": 4, "flags": [True, False], torch.tensor(1): 2}
    with pytest.raises(engine.CheckpointWriteError, match="dict key"):
        codec.encode_state(state)


def test_a_reference_cycle_through_tuples_is_refused_before_it_is_packed_without_end():
    """Entries are packed before they are screened (their bytes are the memo's key); a cycle
    through tuples would recurse through the packer's hook: it stops after a few levels, and the
    screen, then the walk, refuse the tree as too deep."""
    looped: list = []
    looped.append((looped,))
    with pytest.raises(engine.CheckpointWriteError, match="reference cycle"):
        codec.encode_state({"state": looped})
    deep: list = []
    level = deep
    for _ in range(6):  # tuples nested deeper than the packer's bound before the screen: still encoded
        inner: list = []
        level.append((inner,))
        level = inner
    _assert_exact({"deep": deep, "tensor": torch.ones(2)})


def test_the_snapshot_buffer_follows_each_structure_change_exactly():
    """The buffer is laid out again when the table's structure changes (the layout's
    ``structure`` object), and its copies equal the tensors after every capture."""
    state = _state()
    buffers = SnapshotBuffers()
    flats = []
    for change in range(5):
        if change == 1:
            state["module"]["weight"].mul_(3.0)
        elif change == 2:
            state["module"]["weight"] = state["module"]["weight"].view(torch.int32)  # same bytes, other dtype
        elif change == 3:
            state["module"]["weight"] = state["module"]["weight"].reshape(3, 2)
        elif change == 4:
            state["optimizers"][0]["state"][0]["exp_avg_sq"] = torch.full((2, 3), 0.25)
        encoded = codec.encode_state(state)
        copies = buffers.capture(encoded.tensors, encoded.layout)
        assert [(c.dtype, c.shape) for c in copies] == [(t.dtype, t.shape) for t in encoded.tensors]
        assert all(torch.equal(copy_, tensor) for copy_, tensor in zip(copies, encoded.tensors))
        flats.append(buffers.flat)
    assert flats[1] is flats[0]  # values only: the same buffer, no new layout
    assert all(flats[index] is not flats[index - 1] for index in (2, 3, 4))


class _ChangingRun(engine.Callback):
    """After each split: the learning rate and a counter change (scalars of remembered
    entries); after the third, a buffer changes dtype; after the fifth, the optimizer gains a
    state entry."""

    def __init__(self, model: torch.nn.Module, optimizers: list) -> None:
        self.model, self.optimizers, self.splits = model, optimizers, 0

    def on_split_end(self, view: engine.RunView) -> None:
        self.splits += 1
        for group in self.optimizers[0].param_groups:
            group["lr"] *= 0.5
        if self.splits == 3:
            self.model.scale = self.model.scale.to(torch.float64)
        if self.splits == 5:
            parameter = next(iter(self.model.parameters()))
            self.optimizers[0].state[parameter]["seen_splits"] = torch.tensor(self.splits)

    def state_dict(self) -> dict:
        return {"splits": self.splits}

    def load_state_dict(self, state: dict) -> None:
        self.splits = state["splits"]


class _Model(engine.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3, 1)
        self.register_buffer("scale", torch.ones(1))

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        return (self.net(batch) * self.scale).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.1)


@pytest.mark.parametrize("writer", [pytest.param("sync", marks=pytest.mark.exhaustive), "thread",
                                    pytest.param("process", marks=pytest.mark.exhaustive)])
def test_every_checkpoint_of_a_changing_run_holds_the_state_it_was_taken_from(tmp_path, monkeypatch, writer):
    """A real run whose state changes scalars and structure while its snapshots go through the
    remembered structure and the reused buffers: every checkpoint, read back from disk, equals
    the state tree at the instant it was taken, tensor for tensor."""
    import engine.checkpoint.policy as policy

    taken = []
    encode = policy.encode_state

    def recording_encode(tree):
        taken.append(copy.deepcopy({key: value for key, value in tree.items()}))
        return encode(tree)

    monkeypatch.setattr(policy, "encode_state", recording_encode)
    torch.manual_seed(0)
    model = _Model()
    optimizers: list = []
    configure = model.configure_optimizers

    def configure_and_keep() -> torch.optim.Optimizer:
        optimizers.append(configure())
        return optimizers[-1]

    model.configure_optimizers = configure_and_keep  # type: ignore[method-assign]
    batches = [torch.randn(4, 3) for _ in range(8)]
    run_dir = str(tmp_path / "run")
    config = engine.TrainerConfig(max_epochs=1, run_dir=run_dir, progress_bar="off",
                                  checkpoint=engine.CheckpointConfig(every_n_splits=1, keep_last=None, writer=writer))
    engine.Trainer(config, callbacks=[_ChangingRun(model, optimizers)]).fit(model, batches, resume="off")

    store = CheckpointStore(Storage(run_dir, create=False), create=False)
    names = store.names()
    assert len(names) == len(taken) >= 8
    for name, state in zip(names, taken):
        _assert_same(store.load(name).state, state, name)
    scales = [state["module"]["scale"].dtype for state in taken]
    assert torch.float32 in scales and torch.float64 in scales
    assert any("seen_splits" in entry for state in taken for entry in state["optimizers"][0]["state"].values())
    assert len({state["optimizers"][0]["param_groups"][0]["lr"] for state in taken}) >= 8


def _random_value(rng, depth: int):
    kind = rng.randrange(9 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([None, True, False, 0, 1, -7, 2**40, 0.5, -0.0, "s", "", b"b"])
    if kind == 1:
        return torch.full((rng.randrange(4),), float(rng.randrange(9)), dtype=rng.choice([torch.float32, torch.int64]))
    if kind == 2:
        return rng.randrange(-5, 5)
    if kind == 3:
        return rng.random()
    if kind == 4:
        return rng.choice(["a", "bb", "ccc"])
    items = [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 5:
        return items
    if kind == 6:
        return tuple(items)
    return {rng.choice(["x", "y", "z", 0, 1, 2.5, None]): item for item in items}


def _mutate(rng, tree: dict) -> None:
    """Change one thing somewhere in ``tree``, in place: a scalar, a type (to one that packs to
    the same bytes: bytes to bytearray, a tuple to msgpack's ExtType of its bytes, 1 to True), a
    tensor's dtype or shape, an entry added or dropped."""
    containers = [tree]
    for container in containers:
        values = container.values() if isinstance(container, dict) else container
        containers += [value for value in values if isinstance(value, (dict, list))]
    container = rng.choice(containers)
    keys = list(container) if isinstance(container, dict) else list(range(len(container)))
    if not keys or rng.random() < 0.2:
        key = rng.choice(["x", "y", "z", 3]) if isinstance(container, dict) else None
        value = _random_value(rng, 2)
        container.append(value) if key is None else container.__setitem__(key, value)
        return
    key = rng.choice(keys)
    value = container[key]
    if isinstance(value, bytes):
        container[key] = rng.choice([bytearray(value), memoryview(value), value + b"!"])
    elif isinstance(value, tuple):
        container[key] = rng.choice([msgpack.ExtType(2, codec._FastPacker([]).pack(list(value)) if not any(
            isinstance(item, torch.Tensor) for item in value) else b"\x90"), list(value), value + (1,)])
    elif isinstance(value, torch.Tensor):
        container[key] = rng.choice([value.to(torch.float64), value.reshape(-1, 1), value + 1, torch.nn.Parameter(value.float())])
    elif value is True or value == 1:
        container[key] = rng.choice([True, 1, 1.0])
    elif isinstance(value, (dict, list)) and rng.random() < 0.5:
        del container[key]
    else:
        container[key] = _random_value(rng, 2)


def test_random_changes_after_remembered_structures_encode_as_the_walk_or_raise_its_error():
    """Random trees, each changed a little at a time (mostly in ways that keep the packed bytes
    or swap in a type the walk refuses): every encoding equals the walk's, or both refuse."""
    import random

    rng = random.Random(34)
    for _ in range(30):
        tree = {name: _random_value(rng, 1) for name in ("module", "optimizers", "loops", "rng", "callbacks")}
        for _ in range(15):
            walked_error = None
            try:
                header, tensors = _walked(tree)
            except engine.CheckpointWriteError as error:
                walked_error = str(error)
            if walked_error is not None:
                with pytest.raises(engine.CheckpointWriteError) as caught:
                    codec.encode_state(tree)
                assert str(caught.value) == walked_error
            else:
                encoded = codec.encode_state(tree)
                assert encoded.header == header
                assert all(torch.equal(mine, theirs) and mine.dtype == theirs.dtype
                           for mine, theirs in zip(encoded.tensors, tensors, strict=True))
            _mutate(rng, tree)
