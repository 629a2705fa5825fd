"""The writer processes of a torchrun job: ``CheckpointConfig(writer="process")`` with several ranks.

Every rank starts a writer process (engine.checkpoint.writers.process). The writer processes of
one try of the group form a gloo group of their own, and each commits its rank's checkpoints
exactly as the rank's writer thread would: the same committer (GroupCommit, or MemoryFirstCommit
with a memory tier), the same collectives, in the same order on every rank (saves are agreed at
the boundary and none is skipped). The training processes do what comes before the first commit
(the lease, the agreed first sequence, the tiers' claim, the restore) and hand it over
(GroupCommit.writer_process_spec); the writer process takes up from there (:func:`join_writer_group`).

* **Where they meet**: the store the ranks met on (``MASTER_ADDR``/``MASTER_PORT``: torchrun's
  agent store, or env://'s), under a namespace of this try of the group (its ``attempt``), so a
  restarted group never meets a dead try's writer processes.
* **A writer process that dies** is not restarted: its group cannot take a newcomer in. The
  rank's next checkpoint fails (CheckpointWriteError, under ``on_io_error``); with "raise" the
  rank exits and torchrun restarts the group, which resumes exactly.
* **A training process killed**: its writer process commits nothing more (the ranks' writer
  processes hold different snapshots by then, and a commit needs all of them); it exits at once,
  even from inside a collective (engine.checkpoint.writers.process.main.exit_when_orphaned).
  Every checkpoint committed before stays whole: the group commit's protocol holds as with threads.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from engine.checkpoint.store.storage import Storage
from engine.distributed.commit import GroupCommit
from engine.distributed.environment import DistributedContext
from engine.distributed.memory_commit import memory_first_commit
from engine.distributed.writer_group_spec import WriterGroupSpec

def join_writer_group(spec_data: dict[str, Any], run_storage: Storage) -> GroupCommit:
    """The writer process's side: join the group of this try's writer processes (its default
    process group) and return the committer that takes over the rank's commits."""
    spec = WriterGroupSpec.from_dict(spec_data)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    client = dist.TCPStore(spec.host, spec.port, None, is_master=False, timeout=timeout)
    store = dist.PrefixStore(spec.namespace, client)
    dist.init_process_group("gloo", store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout)
    context = DistributedContext(spec.rank, spec.world_size, int(os.environ.get("LOCAL_RANK", "0") or 0),
                                 torch.device("cpu"), dist.group.WORLD, spec.attempt)
    handed = spec.committer
    committer: GroupCommit
    if handed["local_tier"] is None:
        committer = GroupCommit(context)
    else:
        committer = memory_first_commit(context, handed["local_tier"], int(handed["peer_copies"]), run_storage,
                                        int(handed["keep"]))
    committer.take_over(handed)
    return committer


def leave_writer_group() -> None:
    """End the writer process's group (before it exits)."""
    if dist.is_initialized():
        dist.destroy_process_group()
