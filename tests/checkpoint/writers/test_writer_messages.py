"""The typed messages of the writer process (engine.checkpoint.writers.process.messages): each
record round-trips field by field through msgpack framing, and a message of another kind or
version, or with a field missing or unknown, is refused by name."""

import dataclasses

import pytest

from engine.checkpoint.writers.process.channel import FrameReader, encode_message
from engine.checkpoint.writers.process.messages import (MESSAGE_VERSION, CloseMessage, SnapshotMessage, WriterConfig,
                                                        kind_of)
from engine.errors import CheckpointWriteError

SNAPSHOT = SnapshotMessage(7, 1, "/dev/shm/arena/slot-1", 4096, b"header", b"progress", {"epoch": 0, "batch": 2},
                           b'{"step": 3}\n', 128, 140, True, ["val_loss", "min", 0.25], True, False,
                           {"model.weight": 123456789, "progress": 42})
CONFIG = WriterConfig("/runs/a", {"token": "t", "generation": 2}, "/dev/shm/arena", 12, 3, 1, "val_loss",
                      ["ckpt-0000000009"], "skip", {"rank": 1, "world_size": 2, "committer": {"next_sequence": 7}})


def through_the_pipe(data):
    (received,) = FrameReader().feed(encode_message(data))
    return received


@pytest.mark.parametrize("message", [SNAPSHOT, CONFIG, CloseMessage()], ids=["snapshot", "config", "close"])
def test_a_message_round_trips_field_by_field(message):
    received = through_the_pipe(message.to_dict())
    assert kind_of(received) == message.KIND and received["version"] == MESSAGE_VERSION
    back = type(message).from_dict(received)
    for field in dataclasses.fields(message):
        assert getattr(back, field.name) == getattr(message, field.name), field.name
    assert back == message


@pytest.mark.parametrize("change, expected", [
    (lambda data: data.pop("metrics_base"), "fields"),
    (lambda data: data.update(extra=1), "fields"),
    (lambda data: data.update(version=MESSAGE_VERSION + 1), "version"),
    (lambda data: data.update(kind="config"), "'config' message"),
], ids=["missing", "unknown", "version", "kind"])
def test_a_message_that_is_not_what_it_says_is_refused_by_name(change, expected):
    data = SNAPSHOT.to_dict()
    change(data)
    with pytest.raises(CheckpointWriteError, match=expected) as raised:
        SnapshotMessage.from_dict(through_the_pipe(data))
    assert "'snapshot' message of version" in str(raised.value)
