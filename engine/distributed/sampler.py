"""Give each rank its shard of a map-style DataLoader through a ``DistributedSampler``.

A DataLoader over a map-style dataset with a plain sampler is rebuilt with a
``DistributedSampler`` (the engine's own, :class:`~engine.distributed.global_order.GlobalOrderSampler`,
which a resume on another world size re-partitions; shuffled when the original shuffled; ``seed`` 0, so every rank
partitions the same permutation; the engine calls ``set_epoch`` each epoch). A loader that
already has a ``DistributedSampler``, an iterable-style dataset, a custom batch sampler, or any
other iterable is left alone (it must shard itself). ``TrainerConfig.distributed_sampler=False``
turns the insertion off.
"""

from __future__ import annotations

from typing import Any, Iterable

from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from engine.distributed.environment import DistributedContext
from engine.distributed.global_order import GlobalOrderSampler


def shard_loader(data: Iterable[Any], context: DistributedContext) -> Iterable[Any]:
    """``data`` with a DistributedSampler for this rank when it is a map-style DataLoader."""
    if not isinstance(data, DataLoader) or isinstance(data.dataset, IterableDataset):
        return data
    if isinstance(data.sampler, DistributedSampler):
        return data
    batch_sampler = data.batch_sampler
    if batch_sampler is None or type(data.sampler) not in (RandomSampler, SequentialSampler) or \
            getattr(batch_sampler, "sampler", None) is not data.sampler or data.batch_size is None:
        return data  # a custom (batch) sampler: the user decides how it shards
    sampler = GlobalOrderSampler(data.dataset, num_replicas=context.world_size, rank=context.rank,
                                 shuffle=isinstance(data.sampler, RandomSampler), seed=0, drop_last=data.drop_last)
    return DataLoader(
        data.dataset, batch_size=data.batch_size, sampler=sampler, num_workers=data.num_workers,
        collate_fn=data.collate_fn, pin_memory=data.pin_memory, drop_last=data.drop_last, timeout=data.timeout,
        worker_init_fn=data.worker_init_fn, multiprocessing_context=data.multiprocessing_context,
        generator=data.generator, prefetch_factor=data.prefetch_factor if data.num_workers else None,
        persistent_workers=data.persistent_workers, pin_memory_device=data.pin_memory_device,
        in_order=data.in_order,
    )
