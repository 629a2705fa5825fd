"""Values exchanged between ranks in rank order: byte payloads (the values each rank logged) and
rank 0's choice of a seed.

Logged values are reduced by every rank from the payloads of all ranks, read in rank order
(:class:`RankExchange`), never with an ``all_reduce`` whose summation order is the backend's:
the reduced value is the same bits on every rank and on every rerun with the same world size.
The payloads travel as uint8 tensors (no pickle), padded to the longest one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.checkpoint.format.tensor_bytes import tensor_bytes_view
from engine.distributed.environment import DistributedContext


def gather_bytes(context: DistributedContext, payload: bytes, sizes: list[int] | None = None) -> list[bytes]:
    """Every rank's ``payload``, in rank order, on every rank (a collective). ``sizes`` (every
    rank's payload length, when an earlier collective already gathered them) saves a round."""
    if sizes is None:
        sizes = [int(size) for size in _all_gather(context, torch.tensor([len(payload)], dtype=torch.int64))]
    longest = max(sizes)
    if longest == 0:
        return [b""] * context.world_size
    buffer = bytearray(longest)
    buffer[:len(payload)] = payload
    gathered = _all_gather(context, torch.frombuffer(buffer, dtype=torch.uint8))
    return [bytes(tensor_bytes_view(tensor.contiguous())[:size]) for tensor, size in zip(gathered, sizes)]


def _all_gather(context: DistributedContext, local: torch.Tensor) -> list[torch.Tensor]:
    local = local.to(context.device)
    gathered = [torch.empty_like(local) for _ in range(context.world_size)]
    dist.all_gather(gathered, local)
    return [tensor.cpu() for tensor in gathered]


def seed_of_rank_zero(context: DistributedContext, seed: int) -> int:
    """Rank 0's ``seed`` on every rank (a collective): every rank then draws the same numbers,
    e.g. the same permutation of a shuffled validation loader, whose shards must be disjoint."""
    value = torch.tensor([seed], dtype=torch.int64, device=context.device)
    dist.broadcast(value, src=0)
    return int(value.item())


class RankExchange:
    """What the evaluation loop exchanges with the other ranks of a torchrun job (the
    single-process counterpart, :class:`engine.loops.evaluation.OneRank`, exchanges nothing)."""

    def __init__(self, context: DistributedContext) -> None:
        self._context = context

    def gather(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order."""
        return gather_bytes(self._context, payload)

    def seed_of_rank_zero(self, seed: int) -> int:
        """Rank 0's ``seed``."""
        return seed_of_rank_zero(self._context, seed)


class LockstepRanks:
    """A validation pass of a sharded (FSDP2) model: every forward gathers parameters from every
    rank, so the ranks cannot validate blocks of different lengths; each validates every batch,
    in lockstep, and the pass's values are rank 0's (every rank computes the same ones), so each
    sample is counted once."""

    def __init__(self, exchange: RankExchange) -> None:
        self._exchange = exchange

    def gather(self, payload: bytes) -> list[bytes]:
        """Rank 0's ``payload`` alone (a collective all the same)."""
        return self._exchange.gather(payload)[:1]

    def seed_of_rank_zero(self, seed: int) -> int:
        return self._exchange.seed_of_rank_zero(seed)
