"""Give each rank its shard of a map-style DataLoader: training through a ``DistributedSampler``,
validation through a :class:`ContiguousBatches` shard.

Training: a DataLoader over a map-style dataset with a plain sampler is rebuilt with a
``DistributedSampler`` (the engine's own, :class:`GlobalOrderSampler`,
which a resume on another world size re-partitions; shuffled when the original shuffled; ``seed``
0, so every rank partitions the same permutation; the engine calls ``set_epoch`` each epoch).

Validation: the same kind of loader is rebuilt so that rank r of W reads the r-th of W
contiguous blocks of the loader's own batches (the first ``batches % W`` ranks one batch more).
Every batch is validated on exactly one rank, with no padding duplicates (a
``DistributedSampler`` repeats samples to even the shards out, which would count them twice),
and the batches are those one process would validate, in the same order when the ranks'
blocks are read in rank order: so the values reduced across ranks
(:mod:`engine.loops.evaluation`) are the single-process values. A shuffled loader draws its
permutation from the pass's random streams, which are seeded alike on every rank.

A loader that already has a ``DistributedSampler``, an iterable-style dataset, a custom
(batch) sampler, or any other iterable is left alone (it must shard itself).
``TrainerConfig.distributed_sampler=False`` turns both insertions off.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator, Sized

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from engine.distributed.environment import DistributedContext


class GlobalOrderSampler(DistributedSampler):  # type: ignore[type-arg]
    """The engine's sampler: a ``DistributedSampler`` (same permutation, same split of it
    between ranks) that can be re-partitioned for another world size (:meth:`regroup`)."""

    orders_globally = True  # engine.data.position seeds worker samples by their global position

    def regroup(self, world_size: int, rank: int) -> None:
        """Take rank ``rank``'s part of the same global order split ``world_size`` ways."""
        epoch = self.epoch
        DistributedSampler.__init__(self, self.dataset, num_replicas=world_size, rank=rank, shuffle=self.shuffle,
                                    seed=self.seed, drop_last=self.drop_last)
        self.epoch = epoch


def ordered_by_engine(data: Iterable[Any]) -> bool:
    """Whether ``data`` is a DataLoader whose order the engine owns (a :class:`GlobalOrderSampler`
    under the default batch sampler)."""
    return isinstance(data, DataLoader) and isinstance(data.sampler, GlobalOrderSampler) and \
        getattr(data.batch_sampler, "sampler", None) is data.sampler


def shard_loader(data: Iterable[Any], context: DistributedContext) -> Iterable[Any]:
    """``data`` with a DistributedSampler for this rank when it is a map-style DataLoader."""
    if not _shardable(data):
        return data
    assert isinstance(data, DataLoader)
    sampler = GlobalOrderSampler(data.dataset, num_replicas=context.world_size, rank=context.rank,
                                 shuffle=isinstance(data.sampler, RandomSampler), seed=0, drop_last=data.drop_last)
    return _rebuilt(data, batch_size=data.batch_size, sampler=sampler, drop_last=data.drop_last)


def order_alone(data: Iterable[Any]) -> Iterable[Any]:
    """``data`` ordered by the engine for a process that trains alone (the sampler with one
    replica: the order every world size of the run shares, docs/distributed.md) when it is a
    map-style DataLoader; else ``data`` as it is."""
    return shard_loader(data, DistributedContext(0, 1, 0, torch.device("cpu"), None, 0))


def shard_validation_loader(data: Iterable[Any], context: DistributedContext, one_sequence: bool = False) -> Iterable[Any]:
    """``data`` reading only this rank's block of its batches when it is a map-style DataLoader
    (see the module docstring). ``one_sequence``: the batches are one sequence whose hidden state
    runs through the whole pass (``carry_hidden_across_batches``): rank 0 reads them all, since
    a block starting anywhere else would start from a fresh hidden state."""
    if not _shardable(data):
        return data
    assert isinstance(data, DataLoader) and data.batch_sampler is not None
    return _rebuilt(data, batch_sampler=ContiguousBatches(data.batch_sampler, context.rank, context.world_size,
                                                          one_sequence))


class ContiguousBatches(Sampler[list[int]]):
    """Rank ``rank``'s block of the batches of ``batches`` (a batch sampler): the blocks of the
    ranks, in rank order, are the batches of ``batches``, each once. With ``one_sequence`` rank
    0's block is every batch and the others' are empty."""

    def __init__(self, batches: Iterable[list[int]], rank: int, world_size: int, one_sequence: bool = False) -> None:
        self.batches, self.rank, self.world_size, self.one_sequence = batches, rank, world_size, one_sequence

    def bounds(self) -> tuple[int, int]:
        """The first batch of this rank's block and the first one after it."""
        assert isinstance(self.batches, Sized)
        if self.one_sequence:
            return (0, len(self.batches)) if self.rank == 0 else (0, 0)
        base, extra = divmod(len(self.batches), self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (1 if self.rank < extra else 0)

    def __iter__(self) -> Iterator[list[int]]:
        # The whole sampler is iterated up to the block's end (a shuffle draws its permutation
        # at the start, alike on every rank); the batches before the block are index lists only.
        start, end = self.bounds()
        return itertools.islice(iter(self.batches), start, end)

    def __len__(self) -> int:
        start, end = self.bounds()
        return end - start


def _shardable(data: Iterable[Any]) -> bool:
    """A map-style DataLoader batched by a plain sampler (not one the user chose to shard)."""
    if not isinstance(data, DataLoader) or isinstance(data.dataset, IterableDataset):
        return False
    if isinstance(data.sampler, DistributedSampler):
        return False
    batch_sampler = data.batch_sampler
    # A custom (batch) sampler: the user decides how it shards.
    return batch_sampler is not None and type(data.sampler) in (RandomSampler, SequentialSampler) and \
        getattr(batch_sampler, "sampler", None) is data.sampler and data.batch_size is not None


def _rebuilt(data: DataLoader[Any], **sampling: Any) -> DataLoader[Any]:
    """A DataLoader like ``data`` (workers, collation, pinning, ...) but sampling as ``sampling`` says."""
    return DataLoader(
        data.dataset, **sampling, num_workers=data.num_workers, collate_fn=data.collate_fn,
        pin_memory=data.pin_memory, timeout=data.timeout, worker_init_fn=data.worker_init_fn,
        multiprocessing_context=data.multiprocessing_context, generator=data.generator,
        prefetch_factor=data.prefetch_factor if data.num_workers else None,
        persistent_workers=data.persistent_workers, pin_memory_device=data.pin_memory_device, in_order=data.in_order,
    )
