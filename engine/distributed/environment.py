"""Detect a torchrun (torch.distributed.elastic) environment and join its process group.

torchrun sets ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in
each worker; ``TORCHELASTIC_RESTART_COUNT`` counts the group's restarts. A process without
``WORLD_SIZE`` (or with ``WORLD_SIZE=1`` and no process group) runs single-process, unchanged.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import secrets
from typing import Mapping

import torch
import torch.distributed as dist

from engine.errors import ConfigError

# Collectives of the checkpoint writer wait this long for the slowest rank's part.
WRITER_GROUP_TIMEOUT = datetime.timedelta(minutes=30)


@dataclasses.dataclass
class DistributedContext:
    """This process's place in the job and the groups the engine uses.

    ``writer_group`` is a gloo group of its own: the checkpoint writer (possibly a background
    thread) runs its collectives there, never on the training group. ``attempt`` is unique to
    this try of the group (the restart count and a token chosen by rank 0): staging names carry
    it, so a restarted group never writes over files of a previous try."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    writer_group: dist.ProcessGroup | None
    attempt: int

    @property
    def is_writer(self) -> bool:
        """Rank 0 holds the writer lease, writes metrics.jsonl and commits checkpoints."""
        return self.rank == 0

    def rank_tensor(self, values: list[float]) -> torch.Tensor:
        """``values`` as a float64 tensor where the training group's backend can reduce it."""
        return torch.tensor(values, dtype=torch.float64, device=self.device)


def launched_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun (its elastic agent) started this process, whatever its world size."""
    return "TORCHELASTIC_RUN_ID" in (os.environ if environ is None else environ)


def requested_world_size(environ: Mapping[str, str] | None = None) -> int:
    """``WORLD_SIZE`` from the environment (1 when unset), validated."""
    environ = os.environ if environ is None else environ
    return _int_variable(environ, "WORLD_SIZE", 1)


def _int_variable(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name)
    if value is None:
        return default
    if not value.isdigit():
        raise ConfigError(f"environment variable {name}: expected a non-negative int, got {value!r}")
    return int(value)


def _store_of_this_try(environ: Mapping[str, str]) -> dist.Store | None:
    """Under torchrun, the agent's store with keys of this try only. The agent can keep one store
    across restarts of the group; a restarted worker reading a key of the previous try would try
    to connect to a dead peer ("Gloo connectFullMesh failed ... Connection refused")."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    restart = _int_variable(environ, "TORCHELASTIC_RESTART_COUNT", 0)
    client = dist.TCPStore(environ["MASTER_ADDR"], _int_variable(environ, "MASTER_PORT", 0),
                           requested_world_size(environ), is_master=False, timeout=WRITER_GROUP_TIMEOUT)
    return dist.PrefixStore(f"splitloop/try-{restart}", client)


def join(device: torch.device, environ: Mapping[str, str] | None = None) -> DistributedContext | None:
    """Join the job's process group (gloo on CPU, nccl on CUDA) unless the user already did;
    None when this process runs alone (no process group and ``WORLD_SIZE`` 1 or unset)."""
    environ = os.environ if environ is None else environ
    if not dist.is_available():
        return None
    if not dist.is_initialized():
        if requested_world_size(environ) <= 1:
            return None
        for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
            if name not in environ:
                raise ConfigError(f"WORLD_SIZE={environ['WORLD_SIZE']} but {name} is not set: launch with torchrun "
                                  "(see docs/distributed.md) or call torch.distributed.init_process_group yourself")
        backend = "nccl" if device.type == "cuda" else "gloo"
        device_id = device if device.type == "cuda" else None
        store = _store_of_this_try(environ)
        if store is None:
            dist.init_process_group(backend=backend, device_id=device_id)
        else:
            dist.init_process_group(backend=backend, device_id=device_id, store=store,
                                    rank=_int_variable(environ, "RANK", 0), world_size=requested_world_size(environ))
    world_size = dist.get_world_size()
    if world_size <= 1:
        return None
    writer_group = dist.new_group(backend="gloo", timeout=WRITER_GROUP_TIMEOUT)
    restart = _int_variable(environ, "TORCHELASTIC_RESTART_COUNT", 0)
    # Rank 0 draws the token; every rank takes it, so all parts of one try share a staging name.
    token = [restart * 10 ** 9 + secrets.randbelow(10 ** 9)]
    dist.broadcast_object_list(token, src=0, group=writer_group)
    return DistributedContext(dist.get_rank(), world_size, _int_variable(environ, "LOCAL_RANK", 0), device,
                              writer_group, int(token[0]))
