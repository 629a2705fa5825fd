"""The DistributedSampler the engine inserts (and the loaders it leaves alone)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from engine.distributed.environment import DistributedContext
from engine.distributed.sampler import shard_loader


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
