"""Restoring shards into a live sharded model refuses what is not this rank's shard, in one
process (a process group of one rank, gloo)."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.distributed as dist

from engine.checkpoint.shards import TensorShard
from engine.distributed.sharded import is_sharded_module, rebuild_dtensors
from engine.errors import CheckpointIncompatible


@pytest.fixture
def sharded_linear(tmp_path: pathlib.Path):
    """A Linear(3, 4) with fully_shard over a one-rank CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        module = torch.nn.Linear(3, 4)
        fully_shard(module, mesh=init_device_mesh("cpu", (1,)))
        yield module
    finally:
        dist.destroy_process_group()


def test_a_shard_becomes_a_dtensor_with_its_values(sharded_linear: torch.nn.Module) -> None:
    local = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    rebuilt = rebuild_dtensors("ckpt", {"weight": TensorShard(local, (4, 3), (0, 0), (1,), ("shard:0",))}, sharded_linear)
    assert is_sharded_module(sharded_linear)
    assert torch.equal(rebuilt["weight"].to_local(), local) and tuple(rebuilt["weight"].shape) == (4, 3)


@pytest.mark.parametrize("shard, message", [
    (TensorShard(torch.zeros(2, 3), (4, 3), (2, 0), (1,), ("shard:0",)), "lies at offsets \\[2, 0\\]"),
    (TensorShard(torch.zeros(2, 3), (4, 3), (0, 0), (2,), ("shard:0",)), "device mesh of shape \\[2\\]"),
])
def test_a_shard_of_another_layout_is_refused(sharded_linear: torch.nn.Module, shard: TensorShard, message: str) -> None:
    with pytest.raises(CheckpointIncompatible, match=message):
        rebuild_dtensors("ckpt", {"weight": shard}, sharded_linear)


def test_shards_for_a_model_that_is_not_sharded_are_refused() -> None:
    shard = TensorShard(torch.zeros(4, 3), (4, 3), (0, 0), (1,), ("shard:0",))
    with pytest.raises(CheckpointIncompatible, match="this run's model is not sharded"):
        rebuild_dtensors("ckpt", {"weight": shard}, torch.nn.Linear(3, 4))
