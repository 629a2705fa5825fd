"""Sharded tensors in the checkpoint format (codec extension type 4): a DTensor is written as its
local shard and its placement, read back as a TensorShard, and assembled by offsets alone."""

from __future__ import annotations

import pathlib

import msgpack
import pytest
import torch
import torch.distributed as dist

from engine.checkpoint.format.codec import decode_state, encode_state
from engine.checkpoint.format.shards import SavedPieces, TensorShard, assemble
from engine.errors import CheckpointCorrupt


@pytest.fixture
def one_rank_group(tmp_path: pathlib.Path):
    """A process group of this process alone (gloo), so DTensors can be made here."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _decode(encoded) -> object:
    return decode_state(encoded.header, bytearray(b"".join(bytes(chunk) for chunk in encoded.tensor_chunks())))


def test_a_dtensor_is_written_as_its_shard_and_placement(one_rank_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    sharded = distribute_tensor(full, init_device_mesh("cpu", (1,)), [Shard(0)])
    decoded = _decode(encode_state({"weight": sharded, "plain": torch.ones(2)}))
    shard = decoded["weight"]
    assert isinstance(shard, TensorShard)
    assert torch.equal(shard.local, full)
    assert (shard.global_shape, shard.offsets, shard.mesh_shape, shard.placements) == ((4, 3), (0, 0), (1,), ("shard:0",))
    assert torch.equal(decoded["plain"], torch.ones(2))


def test_a_shard_read_back_is_written_again_as_it_was() -> None:
    shard = TensorShard(torch.randn(3, 5), (7, 5), (4, 0), (2,), ("shard:0",))
    again = _decode(encode_state({"weight": shard}))["weight"]
    assert isinstance(again, TensorShard) and torch.equal(again.local, shard.local)
    assert again.placement() == shard.placement()


def test_assemble_places_every_shard_at_its_offsets() -> None:
    full = torch.randn(7, 3)
    shards = [TensorShard(full[4:], (7, 3), (4, 0), (2,), ("shard:0",)),
              TensorShard(full[:4], (7, 3), (0, 0), (2,), ("shard:0",))]
    assert torch.equal(assemble("w", shards), full)


def test_assemble_refuses_shards_that_leave_a_gap_or_disagree() -> None:
    full = torch.randn(7, 3)
    with pytest.raises(CheckpointCorrupt, match="do not cover the global shape"):
        assemble("w", [TensorShard(full[:4], (7, 3), (0, 0), (2,), ("shard:0",))])
    with pytest.raises(CheckpointCorrupt, match="disagree on the global shape"):
        assemble("w", [TensorShard(full[:4], (7, 3), (0, 0), (2,), ("shard:0",)),
                       TensorShard(full[4:], (8, 3), (4, 0), (2,), ("shard:0",))])


def _header_with_shard(payload: object, tensors: int = 1) -> tuple[bytes, bytearray]:
    table = [{"dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}] * tensors
    tree = msgpack.packb({"weight": msgpack.ExtType(4, msgpack.packb(payload))})
    header = msgpack.packb({"format": "splitloop.state", "version": 1, "tensors": table[:1], "tree": tree})
    return header, bytearray(64)


@pytest.mark.parametrize("payload, message", [
    ([5, {"global_shape": [4], "offsets": [0], "mesh_shape": [2], "placements": ["shard:0"]}], "refers to tensor 5"),
    ([0, {"global_shape": [4], "offsets": [3], "mesh_shape": [2], "placements": ["shard:0"]}], "lies outside"),
    ([0, {"global_shape": [4], "offsets": [0], "mesh_shape": [2], "placements": ["partial"]}], "placements"),
    ([0, {"global_shape": [4], "offsets": [0], "mesh_shape": [2], "placements": ["shard:1"]}],
     "name a dimension its global shape \\(4,\\) does not have"),
    ([0, {"global_shape": [4], "offsets": [0]}], "placement is malformed"),
    ("not a list", "not \\[tensor index, placement\\]"),
    # Read from a file: bounded like a tensor-table entry before anything is allocated for them.
    ([0, {"global_shape": [2 ** 40, 8], "offsets": [0, 0], "mesh_shape": [2], "placements": ["shard:0"]}],
     "global shape \\(1099511627776, 8\\) is larger than any real tensor"),
    ([0, {"global_shape": [2 ** 62, 2 ** 62], "offsets": [0, 0], "mesh_shape": [2], "placements": ["shard:0"]}],
     "global_shape is malformed"),
    ([0, {"global_shape": [0, 2 ** 61, 2 ** 61], "offsets": [0, 0, 0], "mesh_shape": [2], "placements": ["shard:0"]}],
     "larger than any real tensor"),
    ([0, {"global_shape": [4], "offsets": [0], "mesh_shape": [0], "placements": ["shard:0"]}],
     "not the shape of a device mesh"),
    ([0, {"global_shape": [4], "offsets": [-1], "mesh_shape": [2], "placements": ["shard:0"]}], "offsets is malformed"),
    ([0, {"global_shape": [4], "offsets": [0], "mesh_shape": [2], "placements": ["shard:\u00b2"]}], "placements"),
])
def test_a_malformed_shard_is_refused_as_corrupt(payload: object, message: str) -> None:
    header, data = _header_with_shard(payload)
    with pytest.raises(CheckpointCorrupt, match=message):
        decode_state(header, data)


def _chunks(length: int, parts: int) -> list[tuple[int, int]]:
    """(offset, size) of each rank's rows under Shard(0) (torch.chunk's split: ceil-sized
    chunks, the last ones shorter or empty), written out independently of the code under test."""
    size = -(-length // parts)
    return [(min(rank * size, length), max(0, min(size, length - rank * size))) for rank in range(parts)]


def test_saved_pieces_give_each_new_rank_its_block_from_the_overlapping_old_shards() -> None:
    # 7 rows saved by 2 ranks (4 + 3) and read back by 3 ranks (3 + 3 + 1): the middle rank's
    # block straddles both old shards.
    full = torch.randn(7, 5)
    pieces = SavedPieces("w", tuple(TensorShard(full[offset:offset + size], (7, 5), (offset, 0), (2,), ("shard:0",))
                                    for offset, size in _chunks(7, 2)))
    for offset, size in _chunks(7, 3):
        assert torch.equal(pieces.region((offset, 0), (size, 5)), full[offset:offset + size])
    assert torch.equal(pieces.whole(), full)


def test_saved_pieces_reshard_along_another_dim_and_from_replicated_copies() -> None:
    full = torch.arange(6 * 7, dtype=torch.float64).reshape(6, 7)
    # A 2-D mesh (2, 2) with (Replicate, Shard(1)): each column block is saved twice.
    shards = [TensorShard(full[:, offset:offset + size], (6, 7), (0, offset), (2, 2), ("replicate", "shard:1"))
              for _ in range(2) for offset, size in _chunks(7, 2)]
    pieces = SavedPieces("w", tuple(shards))
    for offset, size in _chunks(7, 4):
        assert torch.equal(pieces.region((0, offset), (6, size)), full[:, offset:offset + size])
    assert pieces.region((0, 7), (6, 0)).shape == (6, 0)  # an empty block (more ranks than columns)


def test_saved_pieces_refuse_a_block_they_do_not_cover() -> None:
    full = torch.randn(7, 3)
    pieces = SavedPieces("ckpt: module.w", (TensorShard(full[:4], (7, 3), (0, 0), (2,), ("shard:0",)),))
    with pytest.raises(CheckpointCorrupt, match=r"^ckpt: module.w: the saved shards do not cover the global shape "
                                                r"\(7, 3\) in the block at offsets \[3, 0\] of shape \[3, 3\]$"):
        pieces.region((3, 0), (3, 3))


def test_the_fingerprint_of_a_sharded_state_covers_the_shards_and_their_placement() -> None:
    # inspect fingerprints the decoded state of a sharded checkpoint (rank 0's shards).
    from engine.checkpoint.format.fingerprint import fingerprint
    local = torch.randn(4, 3)
    def of(shard: TensorShard) -> str:
        return fingerprint({"w": shard}, [{"state": {0: {"exp_avg": shard}}, "param_groups": []}])
    shard = TensorShard(local, (7, 3), (0, 0), (2,), ("shard:0",))
    assert of(shard) == of(TensorShard(local.clone(), (7, 3), (0, 0), (2,), ("shard:0",)))
    assert of(shard) != of(TensorShard(local + 1, (7, 3), (0, 0), (2,), ("shard:0",)))
    assert of(shard) != of(TensorShard(local, (8, 3), (0, 0), (2,), ("shard:0",)))


def test_saved_pieces_refuse_shards_that_overlap_each_other() -> None:
    # Rows 0-3 and 2-6: the volumes add up to more than the block; a gap could hide behind them.
    full = torch.randn(7, 3)
    pieces = SavedPieces("w", (TensorShard(full[:4], (7, 3), (0, 0), (2,), ("shard:0",)),
                               TensorShard(full[2:6], (7, 3), (2, 0), (2,), ("shard:0",))))
    with pytest.raises(CheckpointCorrupt, match=r"^w: two saved shards overlap at offsets \[2, 0\]$"):
        pieces.whole()


def _rows(full: torch.Tensor, blocks: list[tuple[int, int]], mesh: tuple[int, ...] = (2,)) -> SavedPieces:
    return SavedPieces("ckpt: module.w", tuple(TensorShard(full[offset:offset + size], tuple(full.shape), (offset, 0),
                                                           mesh, ("shard:0",)) for offset, size in blocks))


def test_the_layout_of_saved_pieces_is_checked_from_their_placements_alone() -> None:
    full = torch.randn(7, 3)
    _rows(full, [(0, 4), (4, 3)]).check_layout()
    _rows(torch.randn(1, 3), [(0, 1), (1, 0)]).check_layout()  # an empty shard: more ranks than rows
    with pytest.raises(CheckpointCorrupt, match=r"^ckpt: module.w: the saved shards hold 12 element\(s\) and do not "
                                                r"cover the global shape \(7, 3\) \(21 elements\)$"):
        _rows(full, [(0, 4)]).check_layout()
    with pytest.raises(CheckpointCorrupt, match=r"^ckpt: module.w: two saved shards overlap at offsets \[3, 0\]$"):
        _rows(full, [(0, 4), (3, 3)], mesh=(3,)).check_layout()  # the volumes add up; a row is missing


def test_a_huge_global_shape_the_shards_do_not_cover_is_refused_without_allocating_it() -> None:
    shards = [TensorShard(torch.zeros(4, 3), (2 ** 38, 3), (offset, 0), (2,), ("shard:0",)) for offset in (0, 4)]
    pieces = SavedPieces("w", tuple(shards))
    with pytest.raises(CheckpointCorrupt, match=r"do not cover the global shape \(274877906944, 3\)"):
        pieces.check_layout()  # whole() would ask torch for 3 TiB


@pytest.mark.parametrize("ranks", [3, 40])  # compared pair by pair, and all at once in tensors
def test_overlapping_pieces_are_found_among_many(ranks: int) -> None:
    blocks = [(rank, 1) for rank in range(ranks)]
    _rows(torch.randn(ranks, 3), blocks, mesh=(ranks,)).check_layout()
    # One rank's block grown over its neighbour's row, the last rank's emptied: the volumes still add up.
    blocks[-2], blocks[-1] = (ranks - 3, 2), (ranks, 0)
    with pytest.raises(CheckpointCorrupt, match=f"two saved shards overlap at offsets \\[{ranks - 3}, 0\\]"):
        _rows(torch.randn(ranks, 3), blocks, mesh=(ranks,)).check_layout()


def test_resharding_refuses_shards_that_do_not_tile_a_huge_global_shape_before_cutting_any_block() -> None:
    # A 2-rank checkpoint resumed on 1 rank would cut a block of the whole recorded shape
    # (2**38 x 3 float32: 3 TiB) out of the pieces: the layout is refused first.
    from engine.checkpoint.format.state_keys import MODULE, OPTIMIZERS, SIGNATURE
    from engine.distributed.reshard import every_ranks_pieces

    def part(offset: int) -> dict:
        return {MODULE: {"w": TensorShard(torch.zeros(4, 3), (2 ** 38, 3), (offset, 0), (2,), ("shard:0",))},
                OPTIMIZERS: []}

    encoded = encode_state(part(4))
    files = {"rank-00001.msgpack": bytearray(encoded.header),
             "rank-00001.bin": bytearray(b"".join(bytes(chunk) for chunk in encoded.tensor_chunks()))}
    state = {SIGNATURE: {"world_size": 2, "sharded": True}, **part(0)}
    with pytest.raises(CheckpointCorrupt, match=r"^ckpt: module.w: the saved shards hold 24 element\(s\) and do not "
                                                r"cover the global shape \(274877906944, 3\)"):
        every_ranks_pieces("ckpt", state, files)
