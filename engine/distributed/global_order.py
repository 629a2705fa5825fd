"""The data order of a distributed run is a property of the run, not of its world size.

Over a map-style DataLoader the engine orders the samples of an epoch by one global permutation
(``torch.randperm`` seeded with the sampler's seed, 0, plus the epoch, as ``DistributedSampler``
draws it), consumed in *global batches* of ``G = per-rank batch * world size``. Rank ``r`` of
``W`` takes the positions ``r, r + W, r + 2W, ...`` of each global batch. This is exactly the
order a ``DistributedSampler`` with a ``BatchSampler`` of ``G / W`` gives, so a run that keeps
its world size is unchanged (and resumes bit-exactly). After ``S`` optimizer steps the first
``S * G`` positions of the epoch's permutation are consumed, whatever ``W`` was.

A checkpoint records ``G`` (``global_batch``) and ``W`` (``world_size``) in its signature. A
run resumed with ``W'`` ranks keeps ``G``: each rank's batch becomes ``G / W'``
(:func:`regroup`), the position (batches consumed) is the same number of global batches, and
the per-rank random streams are derived again from the checkpoint (:func:`rank_seed`).
What cannot continue on another world size is refused up front (:func:`refusal`), one line each.
A checkpoint taken inside a batch or an open accumulation window cannot move either; the
checkpoints that can are *anchors* (:func:`is_anchor`, recorded in each manifest), which
``resume="auto"`` falls back to and retention keeps (docs/distributed.md).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Iterable, Mapping

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from engine.checkpoint.format.state_keys import LOOPS, SIGNATURE
from engine.data.position import EpochData
from engine.distributed.sampler import GlobalOrderSampler, order_alone, ordered_by_engine
from engine.distributed.state_parts import WORLD_SIZE, saved_world_size
from engine.errors import CheckpointIncompatible, WorldSizeChangeRefused

GLOBAL_BATCH = "global_batch"


def order_signature(data: Iterable[Any], world_size: int) -> dict[str, int]:
    """What a checkpoint records about the data order: the world size (distributed runs and runs
    resumed from one) and the global batch (when the engine owns the order)."""
    if not ordered_by_engine(data):
        return {WORLD_SIZE: world_size} if world_size > 1 else {}
    assert isinstance(data, DataLoader) and data.batch_sampler is not None  # ordered_by_engine
    return {WORLD_SIZE: world_size, GLOBAL_BATCH: int(getattr(data.batch_sampler, "batch_size")) * world_size}


def regroup(data: DataLoader[Any], global_batch: int, world_size: int, rank: int) -> bool:
    """Make the engine-ordered ``data`` give rank ``rank`` of ``world_size`` its part of each
    global batch of ``global_batch`` samples; whether anything changed."""
    sampler = data.sampler
    batch_sampler = data.batch_sampler
    assert isinstance(sampler, GlobalOrderSampler) and batch_sampler is not None  # ordered_by_engine
    per_rank = global_batch // world_size
    if sampler.num_replicas == world_size and sampler.rank == rank and getattr(batch_sampler, "batch_size") == per_rank:
        return False
    sampler.regroup(world_size, rank)
    # DataLoader forbids re-assigning its batch size; its BatchSampler reads this attribute.
    setattr(batch_sampler, "batch_size", per_rank)
    return True


def refusal(name: str, saved: Mapping[str, Any], world_size: int, data: Iterable[Any],
            module: torch.nn.Module) -> WorldSizeChangeRefused | None:
    """Why checkpoint ``name`` (signature ``saved``) cannot be resumed on ``world_size`` ranks
    with ``data``, or None when it can. Called only when the world size changes."""
    before = saved.get(WORLD_SIZE, 1)
    change = f"{name} was written with world size {before} and this run has world size {world_size}"
    if saved.get("carry_hidden_across_batches"):
        return WorldSizeChangeRefused(
            f"{change}: carry_hidden_across_batches=True carries each rank's hidden state from batch to batch, and "
            f"those streams belong to the {before} rank(s); resume with {before} process(es) or start a new run "
            "directory from its weights (engine.load_weights)")
    own = _users_distributed_sampler(data)
    if own is not None:
        return WorldSizeChangeRefused(f"{change}: {own}")
    global_batch = saved.get(GLOBAL_BATCH)
    if not isinstance(global_batch, int) or not ordered_by_engine(data):
        return WorldSizeChangeRefused(
            f"{change}: the engine did not order its training data (a sampler or batch sampler of the user's, "
            "an iterable dataset, or distributed_sampler=False), so it cannot re-partition it; resume with "
            f"{before} process(es)")
    if global_batch % world_size:
        working = [size for size in range(1, global_batch + 1) if global_batch % size == 0]
        return WorldSizeChangeRefused(
            f"{change}: the global batch G={global_batch} does not split into {world_size} equal parts; "
            f"resume with a world size that divides G: {working}")
    return _refusal_of_uneven_data(change, data, before, world_size)


def _refusal_of_uneven_data(change: str, data: Iterable[Any], before: int, world_size: int) -> WorldSizeChangeRefused | None:
    assert isinstance(data, DataLoader)  # ordered_by_engine
    samples = len(data.dataset)  # type: ignore[arg-type]
    if data.drop_last or (samples % world_size == 0 and samples % before == 0):
        return None
    return WorldSizeChangeRefused(
        f"{change}: the {samples} samples do not split evenly over {before} and {world_size} ranks, so the last "
        "batch of an epoch would repeat other samples (DistributedSampler pads); use drop_last=True on the "
        f"DataLoader or a world size that divides {samples}")


def _users_distributed_sampler(data: Iterable[Any]) -> str | None:
    sampler = getattr(data, "sampler", None)
    if not isinstance(sampler, DistributedSampler) or isinstance(sampler, GlobalOrderSampler):
        return None
    samples = len(sampler.dataset)  # type: ignore[arg-type]
    padded = "" if sampler.total_size <= samples else f" that pads {samples} samples to {sampler.total_size}"
    return (f"the training DataLoader has a DistributedSampler of its own{padded}: the engine cannot re-partition "
            "it; pass a plain shuffled DataLoader (the engine inserts its own sampler) or resume with the same "
            "number of processes")


def rank_seed(checkpoint_rng: Mapping[str, Any], rank: int, step: int) -> int:
    """A seed for rank ``rank``'s random streams after a world-size change: derived from the
    checkpoint's (rank 0's) torch CPU random state, the rank and the optimizer step, so every
    resume of the same checkpoint on the same world size draws the same numbers."""
    digest = hashlib.sha256()
    digest.update(bytes(checkpoint_rng["torch_cpu"].numpy().tobytes()))
    digest.update(f"rank={rank};step={step}".encode())
    return int.from_bytes(digest.digest()[:8], "little") & (2 ** 63 - 1)


def reseed_rank_streams(seed: int) -> None:
    """Seed every global random stream of this process (torch CPU and CUDA, Python, NumPy)."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % 2 ** 32)



def adapt_data(name: str, state: Mapping[str, Any], data: EpochData, module: torch.nn.Module,
               world_size: int, rank: int, distributed_sampler: bool = True) -> int | None:
    """Before a checkpoint is restored: refuse what cannot continue on ``world_size`` ranks, and
    give ``data`` the run's global order split ``world_size`` ways (a no-op when nothing changed).
    ``distributed_sampler``: TrainerConfig's; False leaves a process resuming alone on another
    world size with its loader as given (so the change is refused). The world size the checkpoint
    was written with when it differs from ``world_size``, else None."""
    saved = state[SIGNATURE]
    before = saved_world_size(saved)
    changed = before != world_size
    global_batch = saved.get(GLOBAL_BATCH)
    may_order = distributed_sampler or not changed
    loader = _engine_ordered(data.source, world_size) if may_order and (changed or isinstance(global_batch, int)) \
        else data.source
    if changed:
        reason = refusal(name, saved, world_size, loader, module) or \
            _refusal_inside_a_batch(name, state, before, world_size)
        if reason is not None:
            raise reason
    elif before == 1 and not isinstance(global_batch, int) and ordered_by_engine(loader):
        raise _refusal_of_a_new_order(name)
    if isinstance(global_batch, int):
        if ordered_by_engine(loader):
            assert isinstance(loader, DataLoader)  # ordered_by_engine
            if regroup(loader, global_batch, world_size, rank) or loader is not data.source:
                data.use_loader(loader)
    return before if changed else None


def _engine_ordered(loader: Any, world_size: int) -> Any:
    """A single process resuming a distributed run: its plain DataLoader ordered the run's way
    (with more ranks the engine inserted its sampler already)."""
    if world_size != 1 or ordered_by_engine(loader):
        return loader
    return order_alone(loader)


def is_anchor(state: Mapping[str, Any]) -> bool:
    """Whether the checkpoint of state tree ``state`` can be resumed on another world size as
    far as its position goes: the run's data order is global (``global_batch`` recorded), no
    hidden state is carried across batches, and it was taken at a batch boundary with no
    gradient-accumulation window open. The newest such checkpoint is the one a resume on another
    world size falls back to, and the one retention keeps (the manifest's ``anchor``)."""
    saved = state[SIGNATURE]
    return isinstance(saved.get(GLOBAL_BATCH), int) and not saved.get("carry_hidden_across_batches") and \
        not _inside_a_batch(state[LOOPS])


def _inside_a_batch(loops: Mapping[str, Any]) -> bool:
    """Whether per-rank work is in flight: a batch with splits left to run (at its last split's
    boundary the batch is not ended yet, but nothing of it is left), or an open accumulation
    window (gradients accumulated, not yet stepped)."""
    split = loops.get("split") or {}
    batch_in_flight = bool(loops["data"].get("has_pending_batch")) and not split.get("batch_finished", False)
    return batch_in_flight or any(loops["flow"].get("pending_backward", ()))


def needs_an_anchor(state: Mapping[str, Any], world_size: int) -> bool:
    """Whether a resume on ``world_size`` ranks cannot continue from this checkpoint where it
    stands (another world size, inside a batch) but could from an anchor of the same run."""
    return saved_world_size(state[SIGNATURE]) != world_size and _inside_a_batch(state[LOOPS])


def _refusal_of_a_new_order(name: str) -> CheckpointIncompatible:
    return CheckpointIncompatible(
        f"{name} was written by a single process that read its DataLoader in the loader's own order (its signature "
        "records no global_batch), and this run orders the data the way every world size shares "
        "(TrainerConfig.elastic=True, or torchrun): the order would change mid-run; resume with elastic=False "
        "(distributed_sampler=False under torchrun), or start a new run directory from its weights "
        "(engine.load_weights)")


def _refusal_inside_a_batch(name: str, state: Mapping[str, Any], before: int,
                            world_size: int) -> WorldSizeChangeRefused | None:
    if not _inside_a_batch(state[LOOPS]):
        return None
    return WorldSizeChangeRefused(
        f"{name} was written with world size {before} and this run has world size {world_size}: it was taken "
        "inside a batch or an open gradient-accumulation window, whose per-rank part (the batch in flight, "
        "hidden state, accumulated gradients) belongs to the old ranks; resume from a checkpoint at a batch "
        "boundary where no accumulation window is open (an anchor: `python -m engine inspect` marks them; "
        "resume='auto' falls back to the newest one by itself, so under resume='auto' the run directory holds "
        f"none yet), or with {before} process(es) until one is committed")


def reseed_after_change(checkpoint_rng: Mapping[str, Any], rank: int, step: int) -> None:
    """After restoring a checkpoint of another world size: this rank's streams, derived from
    the checkpoint, the rank and the step (:func:`rank_seed`)."""
    reseed_rank_streams(rank_seed(checkpoint_rng, rank, step))
