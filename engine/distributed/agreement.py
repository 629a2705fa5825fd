"""What the ranks agree on at each split boundary, with one small collective each.

* The losses written to metrics.jsonl: every rank's losses are gathered and averaged in rank
  order (a fixed order, so the mean is the same bits on every run with the same world size);
  with them, the values each rank logged with ``self.log(..., sync=True)`` in the split.
* Whether to stop, whether the stop is a preemption, and whether to checkpoint: each flag is
  the maximum over the ranks. A signal that reaches one rank (or a ``max_time`` that one rank's
  clock passes first) therefore stops every rank at the same boundary, and the checkpoint
  policy's decisions (``every_seconds`` reads a clock) are the same everywhere.
* Whether a split met a numerical anomaly (``TrainerConfig.anomaly``): the lowest rank's that
  did, so every rank rolls back together.
* Once a stop is agreed, why the run ended: the reason of the lowest rank that has one, so the
  end every checkpoint records (replicated, checked equal) is the same on every rank.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from engine.distributed.environment import DistributedContext
from engine.distributed.rank_values import gather_bytes


@dataclasses.dataclass(frozen=True)
class AgreedFlags:
    """The boundary's decisions, equal on every rank."""

    preempted: bool
    stop: bool
    checkpoint: bool


def mean_losses(context: DistributedContext, losses: list[float], synced: bytes = b"") -> tuple[list[float], list[bytes]]:
    """The mean of each loss over the ranks, summed in rank order; and, when any rank has
    ``synced`` bytes (values logged with ``self.log(..., sync=True)``), every rank's, in rank
    order. Their lengths travel with the losses, so a split that synced nothing costs no
    second collective."""
    local = context.rank_tensor([*losses, float(len(synced))])
    gathered = [torch.empty_like(local) for _ in range(context.world_size)]
    dist.all_gather(gathered, local)
    total = gathered[0][:-1].cpu().clone()
    for other in gathered[1:]:
        total += other[:-1].cpu()
    sizes = [int(row[-1].item()) for row in gathered]
    payloads = gather_bytes(context, synced, sizes) if any(sizes) else []
    return (total / context.world_size).tolist(), payloads


def agree(context: DistributedContext, preempted: bool, stop: bool, checkpoint: bool) -> AgreedFlags:
    """Each flag is True on every rank when it is True on any rank."""
    flags = context.rank_tensor([float(preempted), float(stop), float(checkpoint)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    values = flags.cpu().tolist()
    return AgreedFlags(values[0] > 0, values[1] > 0, values[2] > 0)


def agree_on_anomaly(context: DistributedContext, code: int, value: float) -> tuple[int, float]:
    """A numerical anomaly (``code`` > 0, with its ``value``) of the lowest rank that met one, on
    every rank ((0, 0.0) when none did): every rank then rolls back together, and records the
    same anomaly in its (replicated) progress."""
    local = context.rank_tensor([float(code), value])
    gathered = [torch.empty_like(local) for _ in range(context.world_size)]
    dist.all_gather(gathered, local)
    for candidate in gathered:
        found_code, found_value = candidate.cpu().tolist()
        if found_code > 0:
            return int(found_code), float(found_value)
    return 0, 0.0


REASON_BYTES = 1024  # a longer reason is cut (UTF-8 safely) when it is shared


def agree_on_reason(context: DistributedContext, reason: str | None) -> str | None:
    """The ``reason`` of the lowest rank that has one, on every rank (None when no rank has one):
    a collective, called by every rank at the same boundary."""
    candidate = context.rank_tensor([float(context.rank) if reason is not None else math.inf])
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN)
    source = candidate.item()
    if math.isinf(source):
        return None
    encoded = (reason or "").encode()[:REASON_BYTES]
    buffer = context.rank_tensor([float(len(encoded)), *encoded, *[0.0] * (REASON_BYTES - len(encoded))])
    dist.broadcast(buffer, src=int(source))
    values = [int(value) for value in buffer.cpu().tolist()]
    return bytes(values[1:1 + values[0]]).decode(errors="ignore")
