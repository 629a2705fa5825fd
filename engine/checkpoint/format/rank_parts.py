"""The per-rank parts of a distributed checkpoint: which keys each rank saves for itself, and
the check a reader makes of every part before it calls the checkpoint valid.

A checkpoint of ``W`` ranks holds rank 0's whole state tree in its main files and, for each
rank ``r > 0``, that rank's part in ``rank-<r>.bin`` / ``rank-<r>.msgpack``
(engine.checkpoint.format.rank_files): its RNG streams, loop states and callbacks, and, in a sharded
(FSDP2) run, its shards of the model and the optimizers. engine.distributed.state_parts says
why; this module is where the keys and the world size are read, so that the catalogue can
check a checkpoint's parts without importing engine.distributed.

:func:`check_rank_parts` runs whenever a checkpoint is loaded, so when one is chosen: every
part decodes (its tensor table and tree, the tensors being views of the bytes already read and
checksummed), each rank's tree passes the state validator, and in a sharded checkpoint the
ranks' shards of each tensor tile its global shape (from the placements alone). What is chosen
therefore loads on every rank; a part that does not makes the checkpoint invalid, and the
choice goes on to an older one.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from engine.checkpoint.format.codec import decode_state
from engine.checkpoint.format.rank_files import is_rank_file, rank_files
from engine.checkpoint.format.shards import SavedPieces, TensorShard, pair_pieces
from engine.checkpoint.format.state_keys import CALLBACKS, LOOPS, MODULE, OPTIMIZERS, RNG, SIGNATURE, StateValidator
from engine.errors import CheckpointCorrupt

RANK_PART_KEYS = (RNG, LOOPS, CALLBACKS)
SHARDED_PART_KEYS = (MODULE, OPTIMIZERS)
WORLD_SIZE = "world_size"
SHARDED = "sharded"

def is_sharded(signature: Mapping[str, Any]) -> bool:
    """Whether a run signature describes a sharded (FSDP2) run."""
    return signature.get(SHARDED) is True


def rank_part_keys(signature: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys each rank saves for itself: its streams and loops, and its shards when sharded."""
    return RANK_PART_KEYS + SHARDED_PART_KEYS if is_sharded(signature) else RANK_PART_KEYS


def saved_world_size(signature: Mapping[str, Any]) -> int:
    """The world size a checkpoint was written with (1 when its signature does not say; -1 when
    what it says is not a number of ranks)."""
    value = signature.get(WORLD_SIZE, 1)
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def with_rank_part(name: str, state: Mapping[str, Any], part: Any) -> dict[str, Any]:
    """The main state tree with this rank's own per-rank keys in place of rank 0's."""
    expected = rank_part_keys(state[SIGNATURE])
    if not isinstance(part, dict) or set(part) != set(expected):
        keys = sorted(map(str, part)) if isinstance(part, dict) else type(part).__name__
        raise CheckpointCorrupt(f"{name}: a rank part has keys {keys}, expected {sorted(expected)}")
    return {**state, **part}


def decode_rank_part(name: str, files: Mapping[str, bytearray], rank: int) -> Any:
    """The decoded part of rank ``rank`` (> 0) from a checkpoint's rank files; CheckpointCorrupt,
    naming the checkpoint and the part, when it is missing or does not decode."""
    tensors_file, header_file = rank_files(rank)
    if tensors_file not in files or header_file not in files:
        raise CheckpointCorrupt(f"{name}: the part of rank {rank} ({header_file}) is missing")
    try:
        return decode_state(bytes(files[header_file]), files[tensors_file])
    except CheckpointCorrupt as error:
        raise CheckpointCorrupt(f"{name}: the part of rank {rank} ({header_file} / {tensors_file}): {error}") from error


def check_rank_parts(name: str, state: Any, files: Mapping[str, bytearray], validate: StateValidator | None) -> None:
    """Check every per-rank part of checkpoint ``name`` (see the module docstring): ``state`` is
    rank 0's decoded tree, ``files`` the checkpoint's rank files (verified against the
    manifest), ``validate`` the run's state validator (None: the tree's layout only).
    CheckpointCorrupt names the checkpoint, the rank and what is wrong."""
    signature = state.get(SIGNATURE) if isinstance(state, dict) else None
    if not isinstance(signature, dict):
        if files:
            raise CheckpointCorrupt(f"{name}: holds rank parts but its state records no run signature")
        return
    world_size = saved_world_size(signature)
    _check_part_files(name, world_size, files)
    module = state.get(MODULE)
    if not is_sharded(signature) and isinstance(module, dict) and any(map(_is_shard, module.values())):
        raise CheckpointCorrupt(f"{name}: its model holds sharded tensors but its signature does not record a "
                                "sharded run")
    parts = [state]
    for rank in range(1, world_size):
        part = decode_rank_part(name, files, rank)
        merged = with_rank_part(f"{name}: the part of rank {rank}", state, part)
        if validate is not None:
            validate(f"{name} (the part of rank {rank})", merged)
        parts.append(part)
    if is_sharded(signature):
        for key in SHARDED_PART_KEYS:
            _check_mesh(name, world_size, pair_pieces(f"{name}: {key}", [part[key] for part in parts], _dropped))


def _check_part_files(name: str, world_size: int, files: Mapping[str, bytearray]) -> None:
    """The rank files are exactly those of ranks 1..world_size-1 (a .bin and a .msgpack each)."""
    if world_size < 1:
        raise CheckpointCorrupt(f"{name}: its signature records world size {world_size}, not a number of ranks")
    expected = 2 * (world_size - 1)
    listed = sorted(files)
    if len(listed) == expected and all(is_rank_file(file) for file in listed) and \
            set(listed) == {file for rank in range(1, world_size) for file in rank_files(rank)}:
        return
    shown = ", ".join(listed[:4]) + (f" and {len(listed) - 4} more" if len(listed) > 4 else "")
    raise CheckpointCorrupt(f"{name}: written by {world_size} rank(s) (its signature), so it needs the parts of "
                            f"ranks 1..{world_size - 1} (rank-NNNNN.bin/.msgpack each); its manifest lists "
                            f"{shown or 'none'}")


def _is_shard(value: Any) -> bool:
    return isinstance(value, TensorShard)


def _dropped(value: Any) -> None:
    """A replicated leaf: not needed to check the shards."""
    return None


def _check_mesh(name: str, world_size: int, tree: Any) -> None:
    """Every paired tensor was written on a device mesh of ``world_size`` ranks, one shard each."""
    pending = [tree]
    while pending:
        value = pending.pop()
        if isinstance(value, SavedPieces):
            mesh_shape = value.first.mesh_shape
            ranks = math.prod(mesh_shape)
            if ranks != world_size:
                raise CheckpointCorrupt(f"{value.name} was written on a device mesh of shape {list(mesh_shape)} "
                                        f"({ranks} ranks) by {world_size} rank(s)")
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
