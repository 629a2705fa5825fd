"""Restoring shards into a live sharded model refuses what is not this rank's shard, in one
process (a process group of one rank, gloo)."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.distributed as dist

import engine

from engine.checkpoint.format.codec import encode_state
from engine.checkpoint.format.shards import TensorShard
from engine.checkpoint.format.state_keys import MODULE, OPTIMIZERS, SIGNATURE
from engine.distributed.sharded import is_sharded_module, live_shards, rebuild_dtensors
from engine.errors import CheckpointCorrupt, CheckpointIncompatible
from engine.run.state import check_module_state


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


# ---- resharding a checkpoint written by another world size (engine.distributed.reshard) ----------

def _two_rank_checkpoint(weight: torch.Tensor, moment: torch.Tensor, mesh_shape: tuple[int, ...] = (2,),
                         placements: tuple[str, ...] = ("shard:0",), halves: tuple[int, ...] = (0, 1)) -> tuple[dict, dict]:
    """A sharded checkpoint of a Linear(3, 4) as ``len(halves)`` ranks write it, rank r holding
    half ``halves[r]`` of the rows (0-1 or 2-3) of the weight, of its bias and of an Adam moment:
    rank 0's state tree and the other ranks' files."""
    def part(half: int) -> dict:
        def shard(tensor: torch.Tensor) -> TensorShard:
            return TensorShard(tensor[2 * half:2 * half + 2].clone(), tuple(tensor.shape),
                               (2 * half,) + (0,) * (tensor.dim() - 1), mesh_shape, placements)
        return {MODULE: {"weight": shard(weight), "bias": shard(weight[:, 0])},
                OPTIMIZERS: [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": shard(moment)}},
                              "param_groups": [{"lr": 0.1, "params": [0, 1]}]}]}
    files = {}
    for rank, half in enumerate(halves[1:], start=1):
        encoded = encode_state(part(half))
        files[f"rank-{rank:05d}.bin"] = bytearray(b"".join(bytes(chunk) for chunk in encoded.tensor_chunks()))
        files[f"rank-{rank:05d}.msgpack"] = bytearray(encoded.header)
    return {SIGNATURE: {"world_size": len(halves), "sharded": True}, **part(halves[0])}, files


def test_a_checkpoint_of_two_ranks_is_resharded_onto_a_one_rank_mesh(sharded_linear: torch.nn.Module) -> None:
    weight, moment = torch.randn(4, 3), torch.randn(4, 3)
    state, files = _two_rank_checkpoint(weight, moment)
    live = live_shards("ckpt", state, sharded_linear, 1, files)
    assert torch.equal(live[MODULE]["weight"].to_local(), weight)
    assert torch.equal(live[MODULE]["bias"].to_local(), weight[:, 0])
    assert tuple(live[MODULE]["weight"].placements) == tuple(sharded_linear.weight.placements)
    optimizer_state = live[OPTIMIZERS][0]["state"][0]
    assert torch.equal(optimizer_state["exp_avg"].to_local(), moment)
    assert torch.equal(optimizer_state["step"], torch.tensor(3.0))  # replicated: rank 0's
    sharded_linear.load_state_dict(live[MODULE])
    assert torch.equal(sharded_linear.weight.full_tensor(), weight)


def test_a_missing_rank_part_of_the_old_world_is_corrupt(sharded_linear: torch.nn.Module) -> None:
    state, files = _two_rank_checkpoint(torch.randn(4, 3), torch.randn(4, 3))
    del files["rank-00001.bin"]
    with pytest.raises(CheckpointCorrupt, match=r"^ckpt: the part of rank 1 \(rank-00001.msgpack\) is missing$"):
        live_shards("ckpt", state, sharded_linear, 1, files)


def test_a_model_that_is_not_sharded_is_refused_naming_both_world_sizes() -> None:
    state, files = _two_rank_checkpoint(torch.randn(4, 3), torch.randn(4, 3))
    with pytest.raises(CheckpointIncompatible, match=r"^ckpt holds sharded tensors \(written by 2 rank\(s\), resumed on "
                                                     r"1\) but this run's model is not sharded: apply fully_shard"):
        live_shards("ckpt", state, torch.nn.Linear(3, 4), 1, files)


def test_what_cannot_be_resharded_is_refused_in_one_line(sharded_linear: torch.nn.Module) -> None:
    hsdp = _two_rank_checkpoint(torch.randn(4, 3), torch.randn(4, 3), (1, 2), ("replicate", "shard:0"))
    with pytest.raises(CheckpointIncompatible, match=r"^ckpt: module.weight was written on a 2-dimensional device mesh "
                                                     r"\[1, 2\] .*resharding keeps the number of mesh dimensions"):
        live_shards("ckpt", *hsdp[:1], sharded_linear, 1, hsdp[1])
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    by_columns = torch.nn.Linear(3, 4)
    fully_shard(by_columns, mesh=init_device_mesh("cpu", (1,)), shard_placement_fn=lambda p: Shard(p.dim() - 1))
    state, files = _two_rank_checkpoint(torch.randn(4, 3), torch.randn(4, 3))
    with pytest.raises(CheckpointIncompatible, match=r"^ckpt: weight was saved with placements \[Shard\(dim=0\)\] and "
                                                     r"this run shards it as \[Shard\(dim=1\)\]"):
        live_shards("ckpt", state, by_columns, 1, files)
    wrong_shape = torch.nn.Linear(3, 5)
    fully_shard(wrong_shape, mesh=init_device_mesh("cpu", (1,)))
    live = live_shards("ckpt", state, wrong_shape, 1, files)
    with pytest.raises(CheckpointIncompatible, match=r"^ckpt: model entry 'weight' is \(4, 3\) .* in the checkpoint, "
                                                     r"\(5, 3\) .* in the model$"):
        check_module_state("ckpt", wrong_shape, live[MODULE])


def test_a_2d_mesh_checkpoint_is_resharded_onto_a_2d_mesh_of_another_shape(tmp_path: pathlib.Path) -> None:
    # HSDP on a (2, 2) mesh (2 replicas of 2 shards: ranks 0 and 2 hold rows 0-1, ranks 1 and 3
    # rows 2-3) resumed on a (1, 1) mesh: every row comes from one copy.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    weight, moment = torch.randn(4, 3), torch.randn(4, 3)
    state, files = _two_rank_checkpoint(weight, moment, (2, 2), ("replicate", "shard:0"), halves=(0, 1, 0, 1))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        module = torch.nn.Linear(3, 4)
        fully_shard(module, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")))
        live = live_shards("ckpt", state, module, 1, files)
        assert torch.equal(live[MODULE]["weight"].to_local(), weight)
        assert torch.equal(live[OPTIMIZERS][0]["state"][0]["exp_avg"].to_local(), moment)
        module.load_state_dict(live[MODULE])
        assert torch.equal(module.weight.full_tensor(), weight)
    finally:
        dist.destroy_process_group()


def test_rank_parts_of_different_shapes_are_corrupt(sharded_linear: torch.nn.Module) -> None:
    state, files = _two_rank_checkpoint(torch.randn(4, 3), torch.randn(4, 3))
    other, other_files = _two_rank_checkpoint(torch.randn(4, 3), torch.randn(4, 3))
    del state[MODULE]["bias"]  # rank 0's part lacks an entry rank 1's has
    with pytest.raises(CheckpointCorrupt, match=r"^ckpt: module: the ranks' parts hold different entries$"):
        live_shards("ckpt", state, sharded_linear, 1, files)
    other[MODULE]["bias"] = torch.zeros(4)  # sharded in rank 1's part only
    with pytest.raises(CheckpointCorrupt, match=r"^ckpt: module.bias is sharded in rank 1's part but not in rank 0's$"):
        live_shards("ckpt", other, sharded_linear, 1, other_files)


class _Regression(engine.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))

    def training_step(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _fit_regression(tmp_path: pathlib.Path, shard: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = _Regression()
    if shard:  # a one-rank mesh in one process, as a run resumed on one rank from a sharded one
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)
    config = engine.TrainerConfig(max_epochs=2, run_dir=str(tmp_path / f"run-{shard}"), progress_bar="off", device="cpu")
    engine.Trainer(config).fit(model, loader)
    return {key: getattr(value, "full_tensor", lambda: value)() for key, value in model.state_dict().items()}


def test_a_model_sharded_on_a_one_rank_mesh_trains_in_one_process_as_the_unsharded_model(
        sharded_linear: torch.nn.Module, tmp_path: pathlib.Path) -> None:
    # (sharded_linear for its process group of this one process)
    plain, sharded = _fit_regression(tmp_path, shard=False), _fit_regression(tmp_path, shard=True)
    assert plain.keys() == sharded.keys()
    for key in plain:
        assert torch.equal(plain[key], sharded[key]), key


def test_resharded_replicated_values_are_copies_not_views_of_the_bytes_read() -> None:
    # The optimizer keeps the step tensor it loads: a view would keep rank 0's part in memory.
    from engine.distributed.reshard import every_ranks_pieces
    state, files = _two_rank_checkpoint(torch.randn(4, 3), torch.randn(4, 3))
    step = state[OPTIMIZERS][0]["state"][0]["step"]
    paired = every_ranks_pieces("ckpt", state, files)
    copied = paired[OPTIMIZERS][0]["state"][0]["step"]
    assert torch.equal(copied, step) and copied.untyped_storage().data_ptr() != step.untyped_storage().data_ptr()
