"""A Hugging Face ``.shuffle(seed, buffer_size)`` buffer is saved with the stream's state: the
stream yields what ``datasets``' own shuffle yields, and resumed at any example (its state
through the checkpoint codec) it continues as the uninterrupted stream; examples the codec
cannot hold are refused naming the stream and the remedy."""

from __future__ import annotations

import pathlib
import re
import sys
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

import engine
from engine.checkpoint.format.codec import decode_state, encode_state
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.cli.commands import inspect_run
from engine.data.hf_shuffle import STATE_KEY
from engine.data.hf_streams import repair_state_loading
from engine.errors import DataError

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import stream_train  # noqa: E402
from forged_checkpoints import MAIN, rewrite  # noqa: E402
from resume_helpers import assert_same_run, copy_run_until  # noqa: E402

datasets = pytest.importorskip("datasets")
PLACES = ["before-map", "after-map"]  # datasets iterates the buffer as Arrow tables, as examples


@pytest.fixture
def shards(tmp_path):
    return tmp_path / "shards"


def shuffled(shards: pathlib.Path, place: str, epoch: int):
    stream = stream_train.hf_stream(shards, shuffle=place)
    repair_state_loading(stream)
    stream.set_epoch(epoch)
    return stream


def ids(examples) -> list[int]:
    return [int(example["id"]) for example in examples]


def through_codec(state):
    encoded = encode_state(state)
    tensor_data = bytearray(b"".join(bytes(chunk) for chunk in encoded.tensor_chunks()))
    return decode_state(encoded.header, tensor_data)


@pytest.mark.parametrize("place", PLACES)
def test_a_saved_buffer_yields_what_datasets_own_shuffle_yields(place, shards, monkeypatch):
    """The order of an uninterrupted stream is unchanged (two epochs: the shards reshuffled)."""
    patched = [ids(shuffled(shards, place, epoch)) for epoch in (0, 1)]
    shuffle_stage = datasets.iterable_dataset.BufferShuffledExamplesIterable
    for name in ("_init_state_dict", "load_state_dict", "__iter__", "_iter_arrow"):
        monkeypatch.setattr(shuffle_stage, name, getattr(shuffle_stage, name).__wrapped__)
    own = [ids(shuffled(shards, place, epoch)) for epoch in (0, 1)]
    assert patched == own
    assert own[0] != sorted(own[0]) and own[0] != own[1]  # shuffled, and otherwise in the next epoch


# Each shuffle path and each epoch once by default (every combination with -m exhaustive).
@pytest.mark.parametrize("place, epoch", [
    ("after-map", 1), ("before-map", 0),
    pytest.param("after-map", 0, marks=pytest.mark.exhaustive),
    pytest.param("before-map", 1, marks=pytest.mark.exhaustive)])
def test_a_shuffled_stream_resumed_at_any_example_continues_as_the_uninterrupted_one(place, epoch, shards):
    uninterrupted = ids(shuffled(shards, place, epoch))
    for stop in range(len(uninterrupted) + 1):
        stream = shuffled(shards, place, epoch)
        iterator = iter(stream)
        seen = ids(next(iterator) for _ in range(stop))
        state = through_codec(stream.state_dict())
        resumed = shuffled(shards, place, epoch)
        resumed.load_state_dict(state)
        assert seen + ids(resumed) == uninterrupted, f"resumed after {stop} examples"


def test_the_state_holds_the_buffer_content(shards, capsys):
    """What the state costs: the buffer's examples (printed, the size grows with buffer_size)."""
    stream = shuffled(shards, "after-map", 0)
    iterator = iter(stream)
    next(iterator)
    buffer = find_buffer(stream.state_dict())
    in_buffer = len(buffer["pending"]) + len(buffer["kept"])
    assert 0 < in_buffer < stream_train.BUFFER
    with capsys.disabled():
        size = len(encode_state(stream.state_dict()).header)
        print(f"\nshuffle buffer of {stream_train.BUFFER}: {in_buffer} examples in the state, {size:,} bytes encoded")


def find_buffer(state):
    """The shuffle stage's buffer in a stream's state (its stages nest under "examples_iterable")."""
    while STATE_KEY not in state:
        state = state["examples_iterable"]
    return state[STATE_KEY]


class SumOfX(engine.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch):
        return self.layer(batch["x"].reshape(-1, 1).float()).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_examples_a_checkpoint_cannot_hold_are_refused_naming_the_stream_and_the_remedy(shards):
    """NumPy values (a NumPy-formatted map before the shuffle) are not pickle-free state."""
    stream = stream_train.hf_stream(shards).with_format("numpy").map(lambda example: {"x": example["x"] * 2})
    stream = stream.shuffle(seed=0, buffer_size=4).with_format("torch")
    config = engine.TrainerConfig(max_epochs=1, run_dir="memory://hf-shuffle-unstorable", progress_bar="off",
                                  checkpoint=engine.CheckpointConfig(every_n_splits=1))
    with pytest.raises(DataError, match=r"DataLoader over IterableDataset.*shuffle_buffer.*not supported.*before \.shuffle\(\)"):
        engine.Trainer(config).fit(SumOfX(), DataLoader(stream, batch_size=4))


# ---- saved buffers a checkpoint could hold but no stage can take -----------------------------

def _ipc(table, compression=None) -> bytes:
    import pyarrow
    sink = pyarrow.BufferOutputStream()
    with pyarrow.ipc.new_stream(sink, table.schema, options=pyarrow.ipc.IpcWriteOptions(compression=compression)) as out:
        out.write_table(table)
    return sink.getvalue().to_pybytes()


def _kept_rows(kept: bytes, rows: int, compression=None) -> bytes:
    """An IPC stream of the kept table's schema with ``rows`` rows (its first row repeated)."""
    import pyarrow
    table = pyarrow.ipc.open_stream(pyarrow.py_buffer(kept)).read_all()
    return _ipc(table.take([0] * rows), compression)


def _other_schema(kept: bytes) -> bytes:
    import pyarrow
    return _ipc(pyarrow.table({"id": pyarrow.array([1], pyarrow.int32()), "label": ["a"]}))


# What each forgery does to the saved kept tables, and the reason given.
KEPT_FORGERIES = {
    "garbage": (lambda kept: b"\xff" * 64 + kept[:64], "not an Arrow IPC stream"),
    "truncated": (lambda kept: kept[:len(kept) // 2], "not an Arrow IPC stream"),
    "compressed": (lambda kept: _kept_rows(kept, 3, "zstd"), "compressed"),
}
LIVE_FORGERIES = {  # refused against the live stage only (its buffer_size, its schema)
    "oversized": (lambda kept: _kept_rows(kept, stream_train.BUFFER + 1), "hold more than [0-7] rows"),
    "wrong schema": (_other_schema, "holds tables of the schema id: int32\nlabel: string; the stream gives id: int64"),
}


def every_buffer(state) -> list[dict]:
    """Every saved buffer in a state (a stage after the shuffle keeps its own copy of the state
    it resumes the shuffle from: all are forged alike)."""
    found, pending = [], [state]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            if isinstance(value.get(STATE_KEY), dict):
                found.append(value[STATE_KEY])
            pending.extend(value.values())
    return found


def _forged_state(shards, place: str, edit, examples: int = 6):
    """A shuffled stream's state (through the codec) after ``examples`` examples (before the
    map, the stage after the shuffle resumes from a buffer saved after the 4th), ``edit`` applied
    to each saved buffer."""
    stream = shuffled(shards, place, 0)
    iterator = iter(stream)
    for _ in range(examples):
        next(iterator)
    state = through_codec(stream.state_dict())
    for buffer in every_buffer(state):
        edit(buffer)
    return state


@pytest.mark.parametrize("forgery", sorted({**KEPT_FORGERIES, **LIVE_FORGERIES}))
def test_kept_tables_a_stage_cannot_take_are_refused_as_incompatible(forgery, shards):
    edit, reason = {**KEPT_FORGERIES, **LIVE_FORGERIES}[forgery]
    state = _forged_state(shards, "before-map", lambda buffer: buffer.update(kept=edit(buffer["kept"])))
    resumed = shuffled(shards, "before-map", 0)
    resumed.load_state_dict(state)
    with pytest.raises(engine.CheckpointIncompatible, match=f"Hugging Face .shuffle\\(buffer_size=7\\) buffer.*{reason}"):
        next(iter(resumed))


def test_examples_beyond_the_buffer_size_are_refused_on_the_example_path(shards):
    state = _forged_state(shards, "after-map",
                          lambda buffer: buffer.update(pending=[["key", {"id": 0, "x": [0.0]}]] * (stream_train.BUFFER + 1)))
    resumed = shuffled(shards, "after-map", 0)
    resumed.load_state_dict(state)
    with pytest.raises(engine.CheckpointIncompatible, match=r"holds \d+ examples, more than its buffer_size of 7"):
        next(iter(resumed))


# ---- in a checkpoint: invalid when chosen, and resume takes the one before -------------------

@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """A run of one epoch over a Hugging Face stream shuffled before its map (a checkpoint every split)."""
    run_dir = tmp_path_factory.mktemp("hf-shuffle-reference") / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stream_train.train("hf_shuffled-0", str(run_dir), epochs=1, keep_last=None)
    return run_dir


@pytest.mark.parametrize("forgery", ["garbage", pytest.param("truncated", marks=pytest.mark.exhaustive),
                                     pytest.param("compressed", marks=pytest.mark.exhaustive)])
def test_a_checkpoint_whose_shuffle_buffer_does_not_decode_is_invalid_and_resume_takes_the_one_before(
        forgery, reference_run, tmp_path):
    edit, reason = KEPT_FORGERIES[forgery]
    names = CheckpointStore(Storage(str(reference_run))).names()
    forged, previous = names[len(names) // 2], names[len(names) // 2 - 1]
    run_dir = tmp_path / "run"
    copy_run_until(str(reference_run), str(run_dir), forged)

    def forge(state):
        buffers = every_buffer(state)
        assert buffers and all(isinstance(buffer["kept"], bytes) for buffer in buffers)
        for buffer in buffers:
            buffer["kept"] = edit(buffer["kept"])
        return state

    rewrite(run_dir / "checkpoints" / forged, MAIN, forge)
    report = inspect_run(str(run_dir))
    entry = next(entry for entry in report["checkpoints"] if entry["name"] == forged)
    assert entry["valid"] is False and re.search(f"^{forged}: a Hugging Face .shuffle\\(\\) buffer .*{reason}", entry["error"])
    assert report["latest"] == previous
    with pytest.warns(UserWarning, match=f"skipping checkpoint {forged}"):
        result = stream_train.train("hf_shuffled-0", str(run_dir), epochs=1, keep_last=None)
    assert result.resumed_from == previous
    assert_same_run(str(reference_run), str(run_dir))
