"""The check of a checkpoint's rank parts (engine.checkpoint.format.rank_parts), on hand-made trees; a
real 2-rank sharded checkpoint is forged in tests/distributed/test_forged_parts.py."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint.format.codec import encode_state
from engine.checkpoint.format.rank_parts import check_rank_parts
from engine.checkpoint.format.shards import TensorShard
from engine.errors import CheckpointCorrupt


def _shard(rows: tuple[int, int], ranks: int = 1) -> TensorShard:
    return TensorShard(torch.zeros(rows[1], 3), (4, 3), (rows[0], 0), (ranks,), ("shard:0",))


def test_a_one_process_sharded_checkpoint_checks_its_shards_cover_each_tensor() -> None:
    check_rank_parts("ckpt", {"signature": {"sharded": True}, "module": {"w": _shard((0, 4))}, "optimizers": []}, {}, None)
    with pytest.raises(CheckpointCorrupt, match=r"^ckpt: module.w: the saved shards hold 6 element\(s\)"):
        check_rank_parts("ckpt", {"signature": {"sharded": True}, "module": {"w": _shard((0, 2))}, "optimizers": []},
                         {}, None)


def test_shards_under_a_signature_that_does_not_record_sharding_are_corrupt() -> None:
    with pytest.raises(CheckpointCorrupt, match="^ckpt: its model holds sharded tensors but its signature does not"):
        check_rank_parts("ckpt", {"signature": {"world_size": 1}, "module": {"w": _shard((0, 4))}}, {}, None)


@pytest.mark.parametrize("world_size", [0, -1, True, 2 ** 62])
def test_a_world_size_without_its_rank_parts_is_corrupt(world_size: object) -> None:
    encoded = encode_state({"rng": {}, "loops": {}, "callbacks": {}})
    files = {"rank-00001.msgpack": bytearray(encoded.header), "rank-00001.bin": bytearray()}
    with pytest.raises(CheckpointCorrupt, match="^ckpt: (its signature records world size|written by)"):
        check_rank_parts("ckpt", {"signature": {"world_size": world_size}, "module": {}}, files, None)
