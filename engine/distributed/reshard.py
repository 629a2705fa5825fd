"""Every old rank's shards of a sharded (FSDP2) checkpoint, for a run on another mesh.

A sharded checkpoint written by ``W`` ranks holds, in each rank's part, that rank's shard of
every parameter and optimizer moment with its placement (engine.checkpoint.format.shards). A run on
``W'`` ranks (or another mesh of as many dimensions) needs other blocks: :func:`every_ranks_pieces`
pairs, path by path, the shards of all ``W`` parts into one :class:`SavedPieces` per tensor, and
each rank then cuts its new local block out of the pieces that overlap it
(engine.distributed.sharded); the full tensor is never built. The same pairing serves
consolidation in one process (engine.weights), which takes every block.

Cost: the checkpoint store verifies every file of a checkpoint whole (size and checksum against
the manifest), so each rank reads every rank's part, as it does when the world size is unchanged;
decoding makes no copy (the tensors are views of the bytes read), and each rank copies only the
overlapping pieces into its new shards. Peak memory per rank is therefore the checkpoint's size
plus the rank's new shards, for the duration of the restore.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from engine.checkpoint.format.rank_parts import decode_rank_part, saved_world_size
from engine.checkpoint.format.shards import pair_pieces
from engine.checkpoint.format.state_keys import MODULE, OPTIMIZERS, SIGNATURE
from engine.errors import CheckpointCorrupt

SHARDED_KEYS = (MODULE, OPTIMIZERS)


def rank_part(name: str, files: Mapping[str, bytearray], rank: int) -> dict[str, Any]:
    """The decoded part of rank ``rank`` (> 0) from a checkpoint's rank files; CheckpointCorrupt
    when it is missing or holds no sharded state."""
    part = decode_rank_part(name, files, rank)
    if not isinstance(part, dict) or not all(isinstance(part.get(key), (dict, list)) for key in SHARDED_KEYS):
        raise CheckpointCorrupt(f"{name}: the part of rank {rank} holds no module and optimizer state")
    return part


def every_ranks_pieces(name: str, state: Mapping[str, Any], files: Mapping[str, bytearray],
                       keys: Sequence[str] = SHARDED_KEYS) -> dict[str, Any]:
    """``state`` (rank 0's tree) with each shard under ``keys`` replaced by the
    :class:`SavedPieces` of every rank that wrote the checkpoint (the other ranks' parts are
    read from ``files``, the checkpoint's rank files), their layout checked."""
    world_size = saved_world_size(state[SIGNATURE])
    parts = [state] + [rank_part(name, files, rank) for rank in range(1, world_size)]
    return {**state, **{key: pair_pieces(f"{name}: {key}", [part[key] for part in parts], _copied) for key in keys}}


def _copied(value: Any) -> Any:
    """A replicated leaf: rank 0's. A decoded tensor is a view of the bytes read, and the
    optimizer keeps what it loads (Adam's step): a copy lets every rank part be freed once the
    restore is done."""
    return value.clone() if isinstance(value, torch.Tensor) else value
