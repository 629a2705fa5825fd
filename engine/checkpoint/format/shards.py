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
import re
from typing import Any, Callable, Sequence

import torch

from engine.checkpoint.format.bounds import MAX_DIMS, MAX_ELEMENTS, is_count
from engine.errors import CheckpointCorrupt, CheckpointWriteError

REPLICATE = "replicate"
SHARD_PREFIX = "shard:"
_SHARD_NAME = re.compile(r"shard:[0-9]{1,2}", re.ASCII)  # a dimension of at most MAX_DIMS


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
    """A :class:`TensorShard` from a decoded placement record; CheckpointCorrupt if malformed.
    Every size is bounded as a tensor-table entry is (engine.checkpoint.format.bounds): a global shape
    is only ever allocated for after the shards are seen to cover it (:meth:`SavedPieces.check_layout`)."""
    if not isinstance(placement, dict) or set(placement) != {"global_shape", "offsets", "mesh_shape", "placements"}:
        raise CheckpointCorrupt(f"a sharded tensor's placement is malformed: {placement!r}")
    global_shape, offsets = _counts(placement, "global_shape"), _counts(placement, "offsets")
    mesh_shape = _counts(placement, "mesh_shape")
    names = placement["placements"]
    if not isinstance(names, list) or len(names) != len(mesh_shape) or not all(_is_placement(name) for name in names):
        raise CheckpointCorrupt(f"a sharded tensor's placements {names!r} do not match its mesh shape {mesh_shape}")
    if 0 in mesh_shape or math.prod(mesh_shape) > MAX_ELEMENTS:
        raise CheckpointCorrupt(f"a sharded tensor's mesh shape {mesh_shape} is not the shape of a device mesh")
    if math.prod(max(size, 1) for size in global_shape) > MAX_ELEMENTS:
        raise CheckpointCorrupt(f"a sharded tensor's global shape {global_shape} is larger than any real tensor")
    if len(offsets) != len(global_shape) or local.dim() != len(global_shape):
        raise CheckpointCorrupt(f"a sharded tensor's offsets {offsets} do not match its global shape {global_shape}")
    if any(name != REPLICATE and int(name[len(SHARD_PREFIX):]) >= len(global_shape) for name in names):
        raise CheckpointCorrupt(f"a sharded tensor's placements {names!r} name a dimension its global shape "
                                f"{global_shape} does not have")
    local_shape = tuple(local.shape)
    if any(offset + size > whole for offset, size, whole in zip(offsets, local_shape, global_shape)):
        raise CheckpointCorrupt(f"a shard of shape {local_shape} at offsets {offsets} lies outside the "
                                f"global shape {global_shape}")
    return TensorShard(local, global_shape, offsets, mesh_shape, tuple(names))


def _counts(placement: dict[str, Any], key: str) -> tuple[int, ...]:
    value = placement[key]
    if not isinstance(value, list) or len(value) > MAX_DIMS or not all(is_count(item) for item in value):
        raise CheckpointCorrupt(f"a sharded tensor's {key} is malformed: {value!r}")
    return tuple(value)


def _is_placement(name: object) -> bool:
    return name == REPLICATE or (isinstance(name, str) and _SHARD_NAME.fullmatch(name) is not None)


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

    def check_layout(self) -> None:
        """Check from the placements alone (no tensor is allocated, no byte read) that the
        distinct pieces tile the global shape: pairwise disjoint, their volumes adding up to
        its own. The global shape is then no larger than what the pieces hold. CheckpointCorrupt
        when they do not."""
        pieces = self._distinct_pieces()
        shape = self.first.global_shape
        held, whole = sum(math.prod(piece.local.shape) for piece in pieces), math.prod(shape)
        if held != whole:
            raise CheckpointCorrupt(f"{self.name}: the saved shards hold {held} element(s) and do not cover the "
                                    f"global shape {shape} ({whole} elements)")
        overlapping = _first_overlap(pieces)
        if overlapping is not None:
            raise CheckpointCorrupt(f"{self.name}: two saved shards overlap at offsets {list(overlapping.offsets)}")

    def _distinct_pieces(self) -> list[TensorShard]:
        """The pieces with copies of the same block (a replicated mesh dimension) left out."""
        distinct: dict[tuple[tuple[int, ...], tuple[int, ...]], TensorShard] = {}
        for piece in self.pieces:
            distinct.setdefault((piece.offsets, tuple(piece.local.shape)), piece)
        return list(distinct.values())


_OVERLAP_ROWS = 256  # pieces compared with all others at once (bounds the comparison's memory)


def _first_overlap(pieces: list[TensorShard]) -> TensorShard | None:
    """A piece that overlaps an earlier one, or None; all pairs compared at once (a checkpoint
    of many ranks has as many pieces per tensor)."""
    if len(pieces) < 2 or not pieces[0].offsets:
        return None
    if len(pieces) <= _OVERLAP_ROWS // 16:  # a few pieces: cheaper one pair at a time than in tensors
        boxes = [tuple(slice(start, start + size) for start, size in zip(piece.offsets, piece.local.shape))
                 for piece in pieces]
        return next((pieces[later] for later in range(len(boxes)) for earlier in range(later)
                     if _boxes_meet(boxes[earlier], boxes[later])), None)
    starts = torch.tensor([piece.offsets for piece in pieces], dtype=torch.int64)
    stops = starts + torch.tensor([tuple(piece.local.shape) for piece in pieces], dtype=torch.int64)
    later = torch.arange(len(pieces))
    for first in range(0, len(pieces), _OVERLAP_ROWS):
        rows = slice(first, first + _OVERLAP_ROWS)
        meet = (torch.maximum(starts[rows, None], starts[None]) < torch.minimum(stops[rows, None], stops[None])).all(-1)
        meet &= later[None] > later[rows, None]
        if meet.any():
            return pieces[int(meet.nonzero()[0, 1])]
    return None


def pair_pieces(path: str, values: list[Any], leaf: Callable[[Any], Any]) -> Any:
    """One tree from the ranks' trees of the same shape (``values``: rank 0's first): the
    shards of each tensor paired into one :class:`SavedPieces` (its layout checked), any other
    leaf ``leaf(rank 0's value)`` (replicated). CheckpointCorrupt when the trees differ."""
    first = values[0]
    shards = [isinstance(value, TensorShard) for value in values]
    if any(shards) and not all(shards):
        raise CheckpointCorrupt(f"{path} is sharded in rank {shards.index(True)}'s part but not in "
                                f"rank {shards.index(False)}'s")
    if isinstance(first, TensorShard):
        pieces = SavedPieces(path, tuple(values))
        pieces.check_layout()
        return pieces
    if isinstance(first, dict):
        if not all(isinstance(value, dict) and value.keys() == first.keys() for value in values):
            raise CheckpointCorrupt(f"{path}: the ranks' parts hold different entries")
        return {key: pair_pieces(f"{path}.{key}", [value[key] for value in values], leaf) for key in first}
    if isinstance(first, (list, tuple)) and not hasattr(first, "_fields"):
        if not all(type(value) is type(first) and len(value) == len(first) for value in values):
            raise CheckpointCorrupt(f"{path}: the ranks' parts hold lists of different lengths")
        paired = [pair_pieces(f"{path}[{index}]", [value[index] for value in values], leaf) for index in range(len(first))]
        return paired if isinstance(first, list) else tuple(paired)
    return leaf(first)


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
