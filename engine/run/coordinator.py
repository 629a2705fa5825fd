"""One process or a torchrun group: what a run does differently when several processes train.

:class:`~engine.run.run.FitRun` chooses its coordinator once (:func:`join_coordinator`) and never
asks which it holds: :class:`SingleProcess` decides alone; :class:`Group` shards the data, averages
the losses it reports (and reduces the values logged with ``sync=True``), agrees with the other
ranks on every stop and checkpoint decision, and lets rank 0 alone write the run's files
(engine.distributed).
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol

import torch

from engine import distributed, watchdog
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.tiers.tiering import TierPlan
from engine.config import DEFAULT_START_TIMEOUT
from engine.distributed.environment import DistributedContext
from engine.errors import ConfigError
from engine.loops.context import StopState


class Coordinator(Protocol):
    """How this process takes part in the run; see the module docstring."""

    @property
    def context(self) -> DistributedContext | None:
        """The process group the loops sync gradients over (None: this process runs alone)."""

    @property
    def world_size(self) -> int:
        """How many processes train."""

    @property
    def is_writer(self) -> bool:
        """Whether this process writes the run's files (metrics, preemption marker)."""

    def commit_group(self, tiers: TierPlan | None = None, storage: Storage | None = None,
                     keep: int = 0) -> distributed.GroupCommit | None:
        """What the checkpointer commits through across ranks (None: alone); with a memory tier
        in ``tiers`` (``local_tier``), the memory-first committer over the run dir ``storage``."""

    def shard(self, data: Iterable[Any], distributed_sampler: bool) -> Iterable[Any]:
        """The training data this process reads."""

    def seed_of_rank_zero(self, seed: int) -> int:
        """Rank 0's ``seed`` (an int64) on every rank; this process's own alone."""

    def mean_losses(self, losses: list[float], synced: bytes) -> tuple[list[float], list[bytes]]:
        """The losses a split reports: this process's, or their mean over the ranks; and every
        rank's values logged with ``sync=True`` (``synced``), in rank order (none alone)."""

    def agree(self, stop: StopState, checkpoint_due: bool) -> bool:
        """Make the stop decision (in ``stop``) the same on every rank; whether the ranks
        agreed to checkpoint at this boundary."""

    def close(self) -> None:
        """End what the run started for itself (the engine's writer group) when ``fit`` ends."""


class SingleProcess:
    """This process trains alone: every decision is its own. With ``global_order`` (asked by
    ``TrainerConfig.elastic``, or torchrun with ``WORLD_SIZE=1``) it orders its data the way a
    torchrun job does, so that the run can grow to several processes later; ``elastic``: the
    user asked for it, so data the engine cannot order is refused."""

    context: DistributedContext | None = None
    world_size = 1
    is_writer = True

    def __init__(self, global_order: bool = False, elastic: bool = False) -> None:
        self._global_order = global_order or elastic
        self._elastic = elastic

    def commit_group(self, tiers: TierPlan | None = None, storage: Storage | None = None,
                     keep: int = 0) -> distributed.GroupCommit | None:
        return None

    def shard(self, data: Iterable[Any], distributed_sampler: bool) -> Iterable[Any]:
        if not (self._global_order and distributed_sampler):
            return data
        ordered = distributed.order_alone(data)
        if self._elastic and ordered is data:
            raise ConfigError(f"TrainerConfig.elastic=True: the training data, a {type(data).__name__}, is not a "
                              "DataLoader over a map-style dataset with a plain (shuffled or sequential) sampler, so "
                              "the engine cannot order it the way every world size shares; pass such a DataLoader "
                              "or set elastic=False (docs/distributed.md)")
        return ordered

    def seed_of_rank_zero(self, seed: int) -> int:
        return seed

    def mean_losses(self, losses: list[float], synced: bytes) -> tuple[list[float], list[bytes]]:
        return losses, []

    def agree(self, stop: StopState, checkpoint_due: bool) -> bool:
        return checkpoint_due

    def close(self) -> None:
        pass


class Group:
    """This process is one rank of a torchrun job."""

    def __init__(self, context: DistributedContext) -> None:
        self._context = context

    @property
    def context(self) -> DistributedContext | None:
        return self._context

    @property
    def world_size(self) -> int:
        return self._context.world_size

    @property
    def is_writer(self) -> bool:
        return self._context.is_writer

    def commit_group(self, tiers: TierPlan | None = None, storage: Storage | None = None,
                     keep: int = 0) -> distributed.GroupCommit | None:
        if tiers is None or tiers.local_tier is None or storage is None:
            return distributed.GroupCommit(self._context)
        return distributed.memory_first_commit(self._context, tiers.local_tier, tiers.peer_copies, storage, keep)

    def shard(self, data: Iterable[Any], distributed_sampler: bool) -> Iterable[Any]:
        return distributed.shard_loader(data, self._context) if distributed_sampler else data

    def seed_of_rank_zero(self, seed: int) -> int:
        return distributed.RankExchange(self._context).seed_of_rank_zero(seed)

    def mean_losses(self, losses: list[float], synced: bytes) -> tuple[list[float], list[bytes]]:
        watchdog.mark(watchdog.COLLECTIVE)
        values = distributed.mean_losses(self._context, losses, synced)
        watchdog.mark(watchdog.BOUNDARY)
        return values

    def agree(self, stop: StopState, checkpoint_due: bool) -> bool:
        """Every rank takes the same stop and checkpoint decisions at this boundary."""
        watchdog.mark(watchdog.COLLECTIVE)
        agreed = distributed.agree(self._context, stop.preempted, stop.requested, checkpoint_due)
        # Every rank's checkpoint records the same end (the progress is checked equal across
        # ranks): the reason of a rank that stopped by itself, agreed before the others fill one in.
        finish_reason = distributed.agree_on_reason(self._context, stop.finish_reason) if agreed.stop else None
        if agreed.preempted and not stop.preempted:
            stop.request_preemption("preempted (the signal reached another rank)")
        elif agreed.stop and not stop.requested:
            stop.request("stop requested on another rank")
        if agreed.stop:
            stop.finish_reason = finish_reason
        watchdog.mark(watchdog.BOUNDARY)
        return agreed.checkpoint

    def close(self) -> None:
        self._context.close()


def join_coordinator(device: torch.device, elastic: bool = False,
                     start_timeout: float = DEFAULT_START_TIMEOUT) -> Coordinator:
    """Join the torchrun job this process was started in, if any (engine.distributed.join).
    ``elastic``: TrainerConfig.elastic (see :class:`SingleProcess`); ``start_timeout``:
    TrainerConfig.start_timeout."""
    context = distributed.join(device, start_timeout=start_timeout)
    if context is None:
        return SingleProcess(global_order=distributed.launched_by_torchrun(), elastic=elastic)
    return Group(context)
