"""Models sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters are DTensors.

Such a module is never wrapped in DDP: FSDP2 reduce-scatters the gradients itself in its
backward, each rank keeping the shard of the averaged gradient that matches its parameter shard.
FSDP2 gathers a module's parameters in the module's forward hooks, and the engine calls
``training_step``, not ``forward``: :class:`ShardedStep` runs each step *as the root module's
forward* (the root's hooks gather its own parameters and prepare the backward that reduces their
gradients), whatever the step calls inside; the submodules' own hooks do the rest.

Gradient accumulation syncs every micro-step (:class:`ShardedGradientSync`). FSDP2's own
``no_sync`` (``set_requires_gradient_sync(False)``) would keep the window's gradient unsharded,
full size on every rank, in FSDP's private per-parameter state: out of reach of a checkpoint taken
inside the window (so a resume there could not be exact) and as large as the whole model. Synced
every micro-step, the open window's gradient is a sharded DTensor in ``parameter.grad``, saved
and restored like any other shard.

At resume, the shards a checkpoint holds (engine.checkpoint.format.shards.TensorShard) become live
DTensors again on this rank's device mesh (:func:`rebuild_dtensors`), after a check that each
lies at this rank's offsets; loading them copies into the parameters' local tensors in place,
and the optimizers' moments are loaded as DTensors without any ``optimizer.step()``. A
checkpoint of another world size is resharded (:func:`live_shards`): each rank cuts its new
local block of every parameter and moment out of the old ranks' shards that overlap it
(engine.distributed.reshard), on a mesh of as many dimensions with the same placements.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import torch

from engine.checkpoint.store.catalogue import LoadedCheckpoint
from engine.checkpoint.format.shards import REPLICATE, SHARD_PREFIX, SavedPieces, TensorShard, is_dtensor
from engine.checkpoint.format.state_keys import LOOPS, MODULE, OPTIMIZERS, SIGNATURE
from engine.distributed import state_parts
from engine.distributed.reshard import every_ranks_pieces
from engine.errors import CheckpointIncompatible


def sharded_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The module's parameters that are DTensors (applied ``fully_shard``)."""
    return [parameter for parameter in module.parameters() if is_dtensor(parameter)]


def is_sharded_module(module: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` (or another DTensor parallelism) sharded the module's parameters."""
    return bool(sharded_parameters(module))


class ShardedStep:
    """The step as the root's forward, and the flow's gradient-sync hooks for an FSDP2 module
    (see the module docstring): FSDP2 syncs every backward, so nothing is left to do at a
    window's end."""

    def __init__(self, module: torch.nn.Module, step: Callable[..., Any]) -> None:
        from torch.distributed.fsdp import FSDPModule
        for submodule in module.modules():
            if isinstance(submodule, FSDPModule):
                # A module the user left unsynced would accumulate an unsharded gradient that no
                # checkpoint captures.
                submodule.set_requires_gradient_sync(True, recurse=False)

        self.step: Callable[..., Any] = as_root_forward(module, step)

    def set_will_step(self, will_step: bool) -> None:
        """Every micro-step reduce-scatters; the window accumulates sharded gradients."""

    def sync_open_window(self, parameters: list[torch.nn.Parameter]) -> None:
        """An open window's gradients are already reduced (each micro-step synced)."""


def as_root_forward(module: torch.nn.Module, step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` (training or validation) run as the root module's forward, so that FSDP2's root
    hooks gather the root's own parameters around it, whatever the step calls inside."""

    def as_forward(*args: Any, **kwargs: Any) -> Any:
        del module.forward  # calls the step makes reach the module's own forward
        return step(*args, **kwargs)

    @functools.wraps(step)  # keeps the step's signature (batch_idx / split_idx detection)
    def run_step(*args: Any, **kwargs: Any) -> Any:
        module.forward = as_forward
        try:
            return module(*args, **kwargs)
        finally:
            module.__dict__.pop("forward", None)

    return run_step


def live_shards(name: str, state: dict[str, Any], module: torch.nn.Module, world_size: int,
                rank_parts: Mapping[str, bytearray]) -> dict[str, Any]:
    """The sharded checkpoint ``state`` (this rank's tree) with live DTensors on the module's
    mesh in place of its shards: this rank's own shards when the world size is the one it was
    written with; otherwise (``rank_parts``: the checkpoint's other ranks' files) this rank's
    new blocks, resharded from every old rank's shards of the model and the optimizers."""
    saved = state_parts.saved_world_size(state[SIGNATURE])
    if saved == world_size:
        return {**state, **{key: rebuild_dtensors(name, state[key], module) for key in (MODULE, OPTIMIZERS, LOOPS)}}
    _mesh_of(name, module, f" (written by {saved} rank(s), resumed on {world_size})")  # refuse before reading parts
    resharded = every_ranks_pieces(name, state, rank_parts)
    state = {**state, **{key: rebuild_dtensors(name, resharded[key], module) for key in (MODULE, OPTIMIZERS)}}
    _check_placements(name, state[MODULE], module)
    return state


def rebuild_dtensors(name: str, tree: Any, module: torch.nn.Module) -> Any:
    """``tree`` with every TensorShard replaced by a DTensor on the module's device mesh, after
    checking that the shard is the one this rank holds (same mesh shape, placements, offsets);
    and every SavedPieces by this rank's block of it on that mesh."""
    return _rebuild(name, tree, _mesh_of(name, module))


def _mesh_of(name: str, module: torch.nn.Module, written: str = "") -> Any:
    parameters = sharded_parameters(module)
    if not parameters:
        raise CheckpointIncompatible(f"{name} holds sharded tensors{written} but this run's model is not sharded: apply "
                                     "fully_shard before fit or in configure_model, on a one-rank mesh in one process "
                                     "(see docs/distributed.md), or start a new run from engine.load_weights")
    return getattr(parameters[0], "device_mesh")


def _check_placements(name: str, module_state: Mapping[str, Any], module: torch.nn.Module) -> None:
    """Refuse resharded parameters whose placements are not the live ones (a run that shards
    them another way, or with another kind of placement)."""
    for key, parameter in module.named_parameters():
        saved = module_state.get(key)
        if not is_dtensor(parameter) or not is_dtensor(saved):
            continue
        live_placements, saved_placements = list(getattr(parameter, "placements")), list(getattr(saved, "placements"))
        if live_placements != saved_placements:
            raise CheckpointIncompatible(
                f"{name}: {key} was saved with placements {saved_placements} and this run shards it as "
                f"{live_placements}; resharding supports another world size with the same Shard(dim) / "
                "Replicate placements only: shard the model as the run that wrote it did")


def _rebuild(name: str, value: Any, mesh: Any) -> Any:
    if isinstance(value, TensorShard):
        return _live(name, value, mesh)
    if isinstance(value, SavedPieces):
        return _resharded(name, value, mesh)
    if isinstance(value, dict):
        return {key: _rebuild(name, item, mesh) for key, item in value.items()}
    if isinstance(value, list):
        return [_rebuild(name, item, mesh) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_rebuild(name, item, mesh) for item in value)
    return value


def _live(name: str, shard: TensorShard, mesh: Any) -> Any:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if tuple(mesh.shape) != shard.mesh_shape:
        raise CheckpointIncompatible(f"{name} was written on a device mesh of shape {list(shard.mesh_shape)}; this run's "
                                     f"mesh is {list(mesh.shape)}. Resume with the same mesh")
    placements = _placements(shard.placements)
    local_shape, offsets = compute_local_shape_and_global_offset(shard.global_shape, mesh, placements)
    if tuple(offsets) != shard.offsets or tuple(local_shape) != tuple(shard.local.shape):
        raise CheckpointIncompatible(
            f"{name}: a shard of global shape {list(shard.global_shape)} lies at offsets {list(shard.offsets)} "
            f"(shape {list(shard.local.shape)}) in the checkpoint, but this rank holds offsets {list(offsets)} "
            f"(shape {list(local_shape)}). Resume with the same mesh and placements")
    return _dtensor(shard.local, mesh, placements, shard.global_shape)


def _resharded(name: str, pieces: SavedPieces, mesh: Any) -> Any:
    """This rank's block of the tensor ``pieces`` hold, on ``mesh`` with the saved placements."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    saved = pieces.first
    if len(saved.mesh_shape) != mesh.ndim:
        raise CheckpointIncompatible(
            f"{pieces.name} was written on a {len(saved.mesh_shape)}-dimensional device mesh {list(saved.mesh_shape)} "
            f"(placements {list(saved.placements)}); this run's mesh {list(mesh.shape)} has {mesh.ndim}: resharding "
            "keeps the number of mesh dimensions (HSDP stays 2-dimensional); resume on such a mesh")
    placements = _placements(saved.placements)
    local_shape, offsets = compute_local_shape_and_global_offset(saved.global_shape, mesh, placements)
    return _dtensor(pieces.region(tuple(offsets), tuple(local_shape)), mesh, placements, saved.global_shape)


def _placements(names: tuple[str, ...]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard
    return [Replicate() if placement == REPLICATE else Shard(int(placement[len(SHARD_PREFIX):])) for placement in names]


def _dtensor(local: torch.Tensor, mesh: Any, placements: list[Any], global_shape: tuple[int, ...]) -> Any:
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local.to(mesh.device_type), mesh, placements, run_check=False,
                              shape=torch.Size(global_shape), stride=_contiguous_stride(global_shape))


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def consolidated_module_state(loaded: LoadedCheckpoint) -> dict[str, torch.Tensor]:
    """The full model state of a checkpoint in this one process (no process group): for a
    sharded checkpoint, each tensor assembled from every rank's shards by their offsets;
    otherwise the checkpoint's module state as it is."""
    module_state: dict[str, Any] = loaded.state[MODULE]
    if not state_parts.is_sharded(loaded.state[SIGNATURE]):
        return module_state
    paired = every_ranks_pieces(loaded.name, loaded.state, loaded.extra_files, keys=(MODULE,))[MODULE]
    # A buffer is replicated: rank 0's copy.
    return {key: value.whole() if isinstance(value, SavedPieces) else value for key, value in paired.items()}
