"""Distributed training under torchrun: the process group, DDP, data shards, per-rank state and
the commit of one checkpoint by every rank. See docs/distributed.md.

One job per module:

* :mod:`~engine.distributed.variables`: torchrun's environment variables, read without torch;
* :mod:`~engine.distributed.environment`: detect torchrun, join the process group
  (:func:`init_process_group` for a script that needs it before ``fit``);
* :mod:`~engine.distributed.group_start`: the ranks of one try of the group meet, within a bound;
* :mod:`~engine.distributed.data_parallel`: DDP around the training step, ``no_sync``;
* :mod:`~engine.distributed.sharded`: FSDP2-sharded models (no DDP), their shards at resume,
  consolidation in one process;
* :mod:`~engine.distributed.reshard`: every old rank's shards of a checkpoint, for a run on
  another world size (resharding) and for consolidation;
* :mod:`~engine.distributed.sampler`: a DistributedSampler for map-style DataLoaders, a block
  of the batches for validation loaders;
* :mod:`~engine.distributed.global_order`: the run's data order, resuming on another world size;
* :mod:`~engine.distributed.agreement`: losses and stop / checkpoint decisions per boundary;
* :mod:`~engine.distributed.rank_values`: logged values and seeds exchanged in rank order;
* :mod:`~engine.distributed.state_parts`: replicated vs per-rank state, digests, world size;
* :mod:`~engine.distributed.commit`: one checkpoint for all ranks;
* :mod:`~engine.distributed.memory_commit`: memory-first checkpoints (node memory, peer copies);
* :mod:`~engine.distributed.byte_transfer`: bytes and checkpoint parts between ranks;
* :mod:`~engine.distributed.preemption_marker`: a preemption the launcher can see;
* :mod:`~engine.distributed.launch`: ``python -m engine launch -- torchrun ...``.
"""

# Names are imported on first use (PEP 562), as in ``engine``: ``python -m engine launch`` and the
# launcher's modules (launch, requeue, preemption_marker) run without torch, whose import would
# cost the launcher seconds of CPU before it starts the job.
import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from engine.distributed.agreement import AgreedFlags, agree, agree_on_reason, mean_losses
    from engine.distributed.commit import GroupCommit
    from engine.distributed.memory_commit import memory_first_commit
    from engine.distributed.environment import DistributedContext, init_process_group, join
    from engine.distributed.variables import launched_by_torchrun
    from engine.distributed.preemption_marker import preempted_exit_status, register_launched_worker, write_preemption_marker
    from engine.distributed.rank_values import RankExchange
    from engine.distributed.sampler import order_alone, shard_loader, shard_validation_loader

# module -> the names it gives (the same as the TYPE_CHECKING imports above; a test compares them)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "engine.distributed.agreement": ("AgreedFlags", "agree", "agree_on_reason", "mean_losses"),
    "engine.distributed.commit": ("GroupCommit",),
    "engine.distributed.memory_commit": ("memory_first_commit",),
    "engine.distributed.environment": ("DistributedContext", "init_process_group", "join"),
    "engine.distributed.variables": ("launched_by_torchrun",),
    "engine.distributed.preemption_marker": ("preempted_exit_status", "register_launched_worker", "write_preemption_marker"),
    "engine.distributed.rank_values": ("RankExchange",),
    "engine.distributed.sampler": ("order_alone", "shard_loader", "shard_validation_loader"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["AgreedFlags", "DistributedContext", "GroupCommit", "RankExchange", "agree", "agree_on_reason", "init_process_group", "join",
           "launched_by_torchrun", "mean_losses", "memory_first_commit", "order_alone", "preempted_exit_status", "register_launched_worker", "shard_loader", "shard_validation_loader",
           "write_preemption_marker"]


if not _typing.TYPE_CHECKING:  # hidden from mypy, which then still reports a misspelt name

    def __getattr__(name: str) -> object:
        """Import a public name's module the first time the name is used (PEP 562)."""
        module = _MODULE_OF.get(name)
        if module is None:
            raise AttributeError(f"module 'engine.distributed' has no attribute {name!r}")
        value = getattr(_importlib.import_module(module), name)
        globals()[name] = value  # later uses are plain attribute lookups
        return value

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(_MODULE_OF))
