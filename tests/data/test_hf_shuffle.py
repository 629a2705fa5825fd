"""A Hugging Face ``.shuffle(seed, buffer_size)`` buffer is saved with the stream's state: the
stream yields what ``datasets``' own shuffle yields, and resumed at any example (its state
through the checkpoint codec) it continues as the uninterrupted stream; examples the codec
cannot hold are refused naming the stream and the remedy."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import engine
from engine.checkpoint.codec import decode_state, encode_state
from engine.data.hf_shuffle import STATE_KEY
from engine.data.hf_streams import repair_state_loading
from engine.errors import DataError

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import stream_train  # noqa: E402

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
