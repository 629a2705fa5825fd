"""Detect a torchrun (torch.distributed.elastic) environment and join its process group.

torchrun sets ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in
each worker; ``TORCHELASTIC_RESTART_COUNT`` counts the group's restarts. A process without
``WORLD_SIZE`` (or with ``WORLD_SIZE=1`` and no process group) runs single-process, unchanged.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import secrets
import warnings
from typing import Mapping

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout
from torch.distributed.distributed_c10d import _set_pg_timeout

from engine.config import DEFAULT_START_TIMEOUT
from engine.distributed import group_start
from engine.distributed.variables import int_variable, launched_by_torchrun, requested_world_size
from engine.errors import ConfigError, GroupStartTimeout
from engine import watchdog

# Collectives of the checkpoint writer wait this long for the slowest rank's part (joining the
# group waits at most TrainerConfig.start_timeout).
WRITER_GROUP_TIMEOUT = datetime.timedelta(minutes=30)

_started_here: dist.ProcessGroup | None = None  # the default group init_process_group started
_warned = False


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

    def close(self) -> None:
        """End the writer group when ``fit`` ends (the training group stays for the script)."""
        if self.writer_group is not None:
            dist.destroy_process_group(self.writer_group)
            self.writer_group = None

    def rank_tensor(self, values: list[float]) -> torch.Tensor:
        """``values`` as a float64 tensor where the training group's backend can reduce it."""
        return torch.tensor(values, dtype=torch.float64, device=self.device)


def _store_of_this_try(environ: Mapping[str, str], timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, the agent's store with keys of this try only (engine.distributed.group_start:
    the agent keeps one store across restarts of the group, and no counter torchrun hands out is
    the same on every node). Waits at most ``timeout`` for every rank."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    rank, world_size = int_variable(environ, "RANK", 0), requested_world_size(environ)
    client = dist.TCPStore(environ["MASTER_ADDR"], int_variable(environ, "MASTER_PORT", 0), world_size,
                           is_master=False, timeout=timeout)
    token = group_start.agree_on_token(client, rank, world_size, timeout)
    return dist.PrefixStore(f"splitloop/try-{token}", client)


def init_process_group(device: torch.device | str = "cpu", start_timeout: float = DEFAULT_START_TIMEOUT,
                       environ: Mapping[str, str] | None = None) -> None:
    """Initialise the default process group as the engine does, for a script that needs it before
    ``fit`` (``fully_shard`` applied before ``fit``): gloo on the CPU, nccl on CUDA; one rank
    (no network) without torchrun or with ``WORLD_SIZE=1``. Use it instead of
    ``torch.distributed.init_process_group`` under torchrun: torch's own joins the store torchrun
    keeps across restarts and, after a restart, can read the dead try's addresses and fail or
    hang (see engine.distributed.group_start). Waits at most ``start_timeout`` seconds for every
    rank, then raises :class:`engine.errors.GroupStartTimeout` naming the ranks that did not
    arrive. The group stays until the process exits (``fit`` does not end it).

    Example::

        engine.distributed.init_process_group()
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        engine.Trainer(config).fit(model, loader)
    """
    environ = os.environ if environ is None else environ
    if dist.is_initialized():
        raise ConfigError("engine.distributed.init_process_group: the default process group is already initialised; "
                          "call it once, before fit")
    device = torch.device(device)
    timeout = datetime.timedelta(seconds=start_timeout)
    if requested_world_size(environ) <= 1:
        _start_group(device, timeout, (dist.HashStore(), 0, 1))
        return
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if name not in environ:
            raise ConfigError(f"WORLD_SIZE={environ['WORLD_SIZE']} but {name} is not set: launch with torchrun "
                              "(see docs/distributed.md) or start the process group yourself")
    store = _store_of_this_try(environ, timeout)
    # Without torchrun's agent store, env:// starts a store of its own for this try.
    _start_group(device, timeout, None if store is None else (store, int_variable(environ, "RANK", 0),
                                                              requested_world_size(environ)))


def _start_group(device: torch.device, timeout: datetime.timedelta,
                 store: tuple[dist.Store, int, int] | None) -> None:
    """The default group (on ``store``: the store, this rank, the world size; env:// without),
    joined within ``timeout``; its collectives then wait as long as the backend's default (a
    rank validating alone may keep the others waiting for minutes). Ended
    when the interpreter exits: a gloo group left to the interpreter's teardown aborts the
    process now and then ("terminate called without an active exception", SIGABRT), a failed
    worker to torchrun, which then restarts a group whose work was done."""
    global _started_here
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None
    if store is None:
        dist.init_process_group(backend=backend, device_id=device_id, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, device_id=device_id, timeout=timeout, store=store[0], rank=store[1],
                                world_size=store[2])
    default = default_pg_nccl_timeout if backend == "nccl" else default_pg_timeout
    if default is not None:
        _set_pg_timeout(default)
    _started_here = dist.group.WORLD
    atexit.register(_end_group_started_here)


def _end_group_started_here() -> None:
    if dist.is_initialized() and dist.group.WORLD is _started_here:
        dist.destroy_process_group()


def join(device: torch.device, environ: Mapping[str, str] | None = None,
         start_timeout: float = DEFAULT_START_TIMEOUT) -> DistributedContext | None:
    """Join the job's process group (gloo on CPU, nccl on CUDA) unless the user already did;
    None when this process runs alone (no process group and ``WORLD_SIZE`` 1 or unset). Under
    torchrun with ``WORLD_SIZE=1`` a one-rank group is started all the same, so that
    ``configure_model`` can shard the model on it. Every rank must arrive within
    ``start_timeout`` seconds (TrainerConfig.start_timeout)."""
    environ = os.environ if environ is None else environ
    if not dist.is_available():
        return None
    if not dist.is_initialized() and (requested_world_size(environ) > 1 or launched_by_torchrun(environ)):
        # A rank waiting for the others has arrived (engine.watchdog.arrival); one still starting has not.
        watchdog.mark(watchdog.STARTING, watchdog.JOINING)
        init_process_group(device, start_timeout, environ)
    if not dist.is_initialized() or dist.get_world_size() <= 1:
        watchdog.mark(watchdog.STARTING)
        return None
    _warn_of_a_group_on_the_shared_store(environ)
    watchdog.mark(watchdog.STARTING, watchdog.JOINING)
    writer_group = _start_writer_group(datetime.timedelta(seconds=start_timeout))
    restart = int_variable(environ, "TORCHELASTIC_RESTART_COUNT", 0)
    # Rank 0 draws the token; every rank takes it, so all parts of one try share a staging name.
    token = [restart * 10 ** 9 + secrets.randbelow(10 ** 9)]
    dist.broadcast_object_list(token, src=0, group=writer_group)
    watchdog.mark(watchdog.STARTING)
    return DistributedContext(dist.get_rank(), world_size=dist.get_world_size(),
                              local_rank=int_variable(environ, "LOCAL_RANK", 0), device=device,
                              writer_group=writer_group, attempt=int(token[0]))


def _start_writer_group(timeout: datetime.timedelta) -> dist.ProcessGroup:
    """The engine's gloo group for the checkpoint writer, joined within ``timeout``; its
    collectives then wait up to WRITER_GROUP_TIMEOUT for the slowest rank's part."""
    try:
        writer_group = dist.new_group(backend="gloo", timeout=timeout)
    except dist.DistStoreError as error:
        raise GroupStartTimeout(
            f"the engine's writer group did not start within {timeout.total_seconds():g} s "
            f"(TrainerConfig.start_timeout) on rank {dist.get_rank()} of {dist.get_world_size()}: another rank did not "
            "join it, or the training group was started on torchrun's store by torch.distributed.init_process_group "
            "and met the keys of an earlier try (start it with engine.distributed.init_process_group); this rank "
            "exits so that torchrun restarts the group") from error
    _set_pg_timeout(WRITER_GROUP_TIMEOUT, writer_group)
    return writer_group


def _warn_of_a_group_on_the_shared_store(environ: Mapping[str, str]) -> None:
    """A group torch.distributed.init_process_group started on torchrun's agent store: the
    engine's writer group is made on that store too, and after a restart both can meet the
    dead try's keys. Said once per process."""
    global _warned
    if _warned or dist.group.WORLD is _started_here:
        return
    if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return
    _warned = True
    warnings.warn("splitloop: the process group was started by torch.distributed.init_process_group on torchrun's "
                  "store, which keeps the keys of earlier tries of the group: after a restart, joining it (and the "
                  "engine's writer group, made on the same store) can read a dead rank's address and fail or hang. "
                  "Start it with engine.distributed.init_process_group() instead (docs/distributed.md)", stacklevel=4)
