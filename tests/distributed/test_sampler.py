"""The DistributedSampler the engine inserts (and the loaders it leaves alone)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from engine.distributed.environment import DistributedContext
from engine.distributed.sampler import shard_loader, shard_validation_loader


def _context(rank: int, world_size: int = 3) -> DistributedContext:
    return DistributedContext(rank, world_size, rank, torch.device("cpu"), writer_group=None, attempt=0)


def _dataset() -> TensorDataset:
    return TensorDataset(torch.arange(12.0))


def test_each_rank_gets_a_disjoint_shard_of_the_same_permutation() -> None:
    seen = []
    for rank in range(3):
        loader = shard_loader(DataLoader(_dataset(), batch_size=2, shuffle=True), _context(rank))
        assert isinstance(loader.sampler, DistributedSampler) and loader.sampler.shuffle
        loader.sampler.set_epoch(1)
        seen.append([int(x) for (batch,) in loader for x in batch])
    assert sorted(sum(seen, [])) == list(range(12))
    assert seen[0] != seen[1]


def test_an_unshuffled_loader_stays_in_order_within_its_shard() -> None:
    loader = shard_loader(DataLoader(_dataset(), batch_size=2), _context(1))
    assert not loader.sampler.shuffle
    assert [int(x) for (batch,) in loader for x in batch] == [1, 4, 7, 10]


def test_a_users_distributed_sampler_and_other_data_are_kept() -> None:
    own = DataLoader(_dataset(), batch_size=2, sampler=DistributedSampler(_dataset(), num_replicas=3, rank=0))
    assert shard_loader(own, _context(0)) is own
    batches = [torch.zeros(2)]
    assert shard_loader(batches, _context(0)) is batches

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    stream = DataLoader(Stream(), batch_size=2)
    assert shard_loader(stream, _context(0)) is stream


def _validation_blocks(world_size: int, batches: int, one_sequence: bool = False, shuffle: bool = False) -> list[list[int]]:
    """Each rank's validation samples, in the order it reads them (the same seed on every rank,
    as the validation pass seeds its streams)."""
    seen = []
    for rank in range(world_size):
        loader = DataLoader(TensorDataset(torch.arange(float(batches * 2 - 1))), batch_size=2, shuffle=shuffle)
        sharded = shard_validation_loader(loader, _context(rank, world_size), one_sequence)
        torch.manual_seed(5)
        seen.append([int(x) for (batch,) in sharded for x in batch])
    return seen


def test_validation_blocks_hold_every_batch_once_in_rank_order() -> None:
    torch.manual_seed(5)
    alone = [int(x) for (batch,) in DataLoader(TensorDataset(torch.arange(9.0)), batch_size=2, shuffle=True)
             for x in batch]
    blocks = _validation_blocks(3, batches=5, shuffle=True)
    # 5 batches over 3 ranks: 2, 2, 1; no sample padded in twice, the last (partial) batch kept.
    assert [len(block) for block in blocks] == [4, 4, 1]
    assert sum(blocks, []) == alone


def test_fewer_validation_batches_than_ranks_leave_a_rank_nothing() -> None:
    blocks = _validation_blocks(3, batches=2)
    assert blocks == [[0, 1], [2], []]


def test_one_sequence_of_validation_batches_is_read_whole_by_rank_zero() -> None:
    blocks = _validation_blocks(2, batches=3, one_sequence=True)
    assert blocks == [[0, 1, 2, 3, 4], []]


def test_validation_batches_are_kept_by_a_loader_the_user_shards() -> None:
    own = DataLoader(_dataset(), batch_size=2, sampler=DistributedSampler(_dataset(), num_replicas=3, rank=0))
    assert shard_validation_loader(own, _context(0)) is own
    batches = [torch.zeros(2)]
    assert shard_validation_loader(batches, _context(0)) is batches
