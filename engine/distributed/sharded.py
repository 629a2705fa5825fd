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

At resume, the shards a checkpoint holds (engine.checkpoint.shards.TensorShard) become live
DTensors again on this rank's device mesh (:func:`rebuild_dtensors`), after a check that each
lies at this rank's offsets; loading them copies into the parameters' local tensors in place,
and the optimizers' moments are loaded as DTensors without any ``optimizer.step()``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from engine.checkpoint.catalogue import LoadedCheckpoint
from engine.checkpoint.codec import decode_state
from engine.checkpoint.rank_files import rank_files
from engine.checkpoint.shards import REPLICATE, SHARD_PREFIX, TensorShard, assemble, is_dtensor
from engine.checkpoint.state_keys import MODULE, SIGNATURE
from engine.distributed import state_parts
from engine.errors import CheckpointCorrupt, CheckpointIncompatible


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


def rebuild_dtensors(name: str, tree: Any, module: torch.nn.Module) -> Any:
    """``tree`` with every TensorShard replaced by a DTensor on the module's device mesh, after
    checking that the shard is the one this rank holds (same mesh shape, placements, offsets)."""
    parameters = sharded_parameters(module)
    if not parameters:
        raise CheckpointIncompatible(f"{name} holds sharded tensors but this run's model is not sharded: apply "
                                     "fully_shard before fit or in configure_model (see docs/distributed.md)")
    mesh = getattr(parameters[0], "device_mesh")
    return _rebuild(name, tree, mesh)


def _rebuild(name: str, value: Any, mesh: Any) -> Any:
    if isinstance(value, TensorShard):
        return _live(name, value, mesh)
    if isinstance(value, dict):
        return {key: _rebuild(name, item, mesh) for key, item in value.items()}
    if isinstance(value, list):
        return [_rebuild(name, item, mesh) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_rebuild(name, item, mesh) for item in value)
    return value


def _live(name: str, shard: TensorShard, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if tuple(mesh.shape) != shard.mesh_shape:
        raise CheckpointIncompatible(f"{name} was written on a device mesh of shape {list(shard.mesh_shape)}; this run's "
                                     f"mesh is {list(mesh.shape)}. Resume with the same mesh")
    placements = [Replicate() if placement == REPLICATE else Shard(int(placement[len(SHARD_PREFIX):]))
                  for placement in shard.placements]
    local_shape, offsets = compute_local_shape_and_global_offset(shard.global_shape, mesh, placements)
    if tuple(offsets) != shard.offsets or tuple(local_shape) != tuple(shard.local.shape):
        raise CheckpointIncompatible(
            f"{name}: a shard of global shape {list(shard.global_shape)} lies at offsets {list(shard.offsets)} "
            f"(shape {list(shard.local.shape)}) in the checkpoint, but this rank holds offsets {list(offsets)} "
            f"(shape {list(local_shape)}). Resume with the same mesh and placements")
    local = shard.local.to(mesh.device_type)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shard.global_shape),
                              stride=_contiguous_stride(shard.global_shape))


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
    parts = [module_state] + [_rank_module_state(loaded, rank)
                              for rank in range(1, state_parts.saved_world_size(loaded.state[SIGNATURE]))]
    full: dict[str, torch.Tensor] = {}
    for key, value in module_state.items():
        if isinstance(value, TensorShard):
            shards = [part.get(key) for part in parts]
            if not all(isinstance(shard, TensorShard) for shard in shards):
                raise CheckpointCorrupt(f"{loaded.name}: {key} is sharded in rank 0's part but not in every rank's")
            full[key] = assemble(f"{loaded.name}: {key}", [shard for shard in shards if isinstance(shard, TensorShard)])
        else:
            full[key] = value  # a buffer: replicated, rank 0's copy
    return full


def _rank_module_state(loaded: LoadedCheckpoint, rank: int) -> dict[str, Any]:
    tensors_file, header_file = rank_files(rank)
    if tensors_file not in loaded.extra_files or header_file not in loaded.extra_files:
        raise CheckpointCorrupt(f"{loaded.name}: the part of rank {rank} ({header_file}) is missing")
    part = decode_state(bytes(loaded.extra_files[header_file]), loaded.extra_files[tensors_file])
    if not isinstance(part, dict) or not isinstance(part.get(MODULE), dict):
        raise CheckpointCorrupt(f"{loaded.name}: the part of rank {rank} holds no module state")
    return part[MODULE]
