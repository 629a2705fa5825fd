"""One rank's shard of a sharded tensor (an FSDP2 ``DTensor``), as a checkpoint stores it.

A ``DTensor`` is written as its local tensor plus its placement: the device mesh's shape, the
placements (``shard:<dim>`` or ``replicate`` per mesh dimension), the global shape and the
offsets of the local tensor inside the global one. Reading gives back a :class:`TensorShard`;
the distributed package turns it into a live ``DTensor`` again (engine.distributed.sharded), and
:func:`assemble` builds the full tensor from every rank's shards in one plain process (no
process group), by offsets alone. On another mesh, :class:`SavedPieces` (every old rank's shard
of one tensor) gives the block a new rank holds (:meth:`SavedPieces.region`), copying only the
parts of the old shards that overlap it: the full tensor is never built.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch

from engine.errors import CheckpointCorrupt, CheckpointWriteError

REPLICATE = "replicate"
SHARD_PREFIX = "shard:"


@dataclasses.dataclass(frozen=True)
class TensorShard:
    """The part of a global tensor one rank holds, and where it lies in the global tensor."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple[str, ...]

    def placement(self) -> dict[str, Any]:
        """The recorded placement as plain data (what the checkpoint header holds)."""
        return {"global_shape": list(self.global_shape), "offsets": list(self.offsets),
                "mesh_shape": list(self.mesh_shape), "placements": list(self.placements)}


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (without importing it when
    torch.distributed is unavailable)."""
    if not isinstance(value, torch.Tensor) or type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(value, DTensor)


def shard_of(tensor: Any) -> TensorShard:
    """This rank's shard of the DTensor ``tensor`` (its local tensor is referenced, not copied)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    names = []
    for placement in tensor.placements:
        if isinstance(placement, Shard):
            names.append(f"{SHARD_PREFIX}{placement.dim}")
        elif isinstance(placement, Replicate):
            names.append(REPLICATE)
        else:
            raise CheckpointWriteError(f"cannot store a DTensor with placement {placement} (a pending reduction): "
                                       "checkpoint after the optimizer step, when every value is sharded or replicated")
    local = tensor.to_local()
    _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return TensorShard(local, tuple(tensor.shape), tuple(int(offset) for offset in offsets),
                       tuple(tensor.device_mesh.shape), tuple(names))


def shard_from_plain(local: torch.Tensor, placement: Any) -> TensorShard:
    """A :class:`TensorShard` from a decoded placement record; CheckpointCorrupt if malformed."""
    if not isinstance(placement, dict) or set(placement) != {"global_shape", "offsets", "mesh_shape", "placements"}:
        raise CheckpointCorrupt(f"a sharded tensor's placement is malformed: {placement!r}")
    global_shape, offsets = _counts(placement, "global_shape"), _counts(placement, "offsets")
    mesh_shape = _counts(placement, "mesh_shape")
    names = placement["placements"]
    if not isinstance(names, list) or len(names) != len(mesh_shape) or not all(_is_placement(name) for name in names):
        raise CheckpointCorrupt(f"a sharded tensor's placements {names!r} do not match its mesh shape {mesh_shape}")
    if len(offsets) != len(global_shape) or local.dim() != len(global_shape):
        raise CheckpointCorrupt(f"a sharded tensor's offsets {offsets} do not match its global shape {global_shape}")
    if any(name != REPLICATE and int(name[len(SHARD_PREFIX):]) >= len(global_shape) for name in names):
        raise CheckpointCorrupt(f"a sharded tensor's placements {names!r} name a dimension its global shape "
                                f"{global_shape} does not have")
    if any(offset + size > whole for offset, size, whole in zip(offsets, local.shape, global_shape)):
        raise CheckpointCorrupt(f"a shard of shape {tuple(local.shape)} at offsets {offsets} lies outside the "
                                f"global shape {global_shape}")
    return TensorShard(local, global_shape, offsets, mesh_shape, tuple(names))


def _counts(placement: dict[str, Any], key: str) -> tuple[int, ...]:
    value = placement[key]
    if not isinstance(value, list) or not all(isinstance(item, int) and not isinstance(item, bool) and item >= 0
                                              for item in value):
        raise CheckpointCorrupt(f"a sharded tensor's {key} is malformed: {value!r}")
    return tuple(value)


def _is_placement(name: object) -> bool:
    if name == REPLICATE:
        return True
    return isinstance(name, str) and name.startswith(SHARD_PREFIX) and name[len(SHARD_PREFIX):].isdigit()


@dataclasses.dataclass(frozen=True)
class SavedPieces:
    """Every old rank's shard of one sharded tensor: what a checkpoint written on one mesh
    offers a run resharding it onto another (engine.distributed.reshard)."""

    name: str
    pieces: tuple[TensorShard, ...]

    def __post_init__(self) -> None:
        first = self.pieces[0]
        for piece in self.pieces[1:]:
            if (piece.global_shape, piece.local.dtype, piece.placements, piece.mesh_shape) != \
                    (first.global_shape, first.local.dtype, first.placements, first.mesh_shape):
                raise CheckpointCorrupt(
                    f"{self.name}: the ranks' shards disagree on the global shape, dtype or placement "
                    f"({piece.global_shape} {piece.local.dtype} {list(piece.placements)} vs "
                    f"{first.global_shape} {first.local.dtype} {list(first.placements)})")

    @property
    def first(self) -> TensorShard:
        """One of the pieces (they agree on global shape, dtype, placements and mesh shape)."""
        return self.pieces[0]

    def whole(self) -> torch.Tensor:
        """The full tensor (consolidation in one process)."""
        return self.region((0,) * len(self.first.global_shape), self.first.global_shape)

    def region(self, offsets: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
        """The block of the global tensor at ``offsets`` of ``shape``, copied from the pieces
        that overlap it (a replicated block is copied once). CheckpointCorrupt when the pieces
        do not cover it, or overlap each other inside it."""
        block = torch.empty(tuple(shape), dtype=self.first.local.dtype)
        filled: list[tuple[slice, ...]] = []
        for piece in self._distinct_pieces():
            overlap = _overlap(piece, offsets, shape)
            if overlap is None:
                continue
            inside_block, inside_piece = overlap
            if any(_boxes_meet(inside_block, other) for other in filled):
                raise CheckpointCorrupt(f"{self.name}: two saved shards overlap at offsets {list(piece.offsets)}")
            block[inside_block] = piece.local[inside_piece].to("cpu")
            filled.append(inside_block)
        # Disjoint boxes inside the block cover it when their volumes add up to its own.
        if sum(math.prod(part.stop - part.start for part in box) for box in filled) != block.numel():
            raise CheckpointCorrupt(f"{self.name}: the saved shards do not cover the global shape "
                                    f"{self.first.global_shape} in the block at offsets {list(offsets)} of shape {list(shape)}")
        return block

    def _distinct_pieces(self) -> list[TensorShard]:
        """The pieces with copies of the same block (a replicated mesh dimension) left out."""
        distinct: dict[tuple[tuple[int, ...], tuple[int, ...]], TensorShard] = {}
        for piece in self.pieces:
            distinct.setdefault((piece.offsets, tuple(piece.local.shape)), piece)
        return list(distinct.values())


def _boxes_meet(first: tuple[slice, ...], second: tuple[slice, ...]) -> bool:
    return all(max(a.start, b.start) < min(a.stop, b.stop) for a, b in zip(first, second))


def _overlap(piece: TensorShard, offsets: Sequence[int],
             shape: Sequence[int]) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Where ``piece`` and the block at ``offsets`` of ``shape`` meet: (slices into the block,
    slices into the piece), or None when they do not."""
    inside_block, inside_piece = [], []
    for start, size, piece_start, piece_size in zip(offsets, shape, piece.offsets, piece.local.shape):
        low, high = max(start, piece_start), min(start + size, piece_start + piece_size)
        if high <= low:
            return None
        inside_block.append(slice(low - start, high - start))
        inside_piece.append(slice(low - piece_start, high - piece_start))
    return tuple(inside_block), tuple(inside_piece)


def assemble(name: str, shards: Sequence[TensorShard]) -> torch.Tensor:
    """The full tensor from every rank's shards of it, placed by their offsets. CheckpointCorrupt
    when the shards disagree on the global shape or do not cover it."""
    return SavedPieces(name, tuple(shards)).whole()
