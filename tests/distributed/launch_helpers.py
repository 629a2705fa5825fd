"""Signal a job started through ``python -m engine launch`` the ways a cluster does, and check
what it leaves: the launcher's status, the processes still alive, the checkpoints, the marker."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time

from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.distributed.launch import ZOMBIE_STATES, descendants, process_table

import torchrun_helpers as helpers

# Where the signal goes: the launcher only (SLURM's B: with exec), its process group (kill --
# -PGID, a batch shell's group), or every process of the job (SLURM signals every task).
TARGETS = ("launcher", "group", "every")
PHASES = ("training", "validation")
SLOW = ("--slow", "0.2")


def phase_options(phase: str) -> tuple[str, ...]:
    """dist_train.py options: one checkpoint only (the preemption's, also when a loaded machine
    delivers the signal after an epoch end), slowed down, and with a slow validation pass after
    each epoch when the signal must land in validation (long enough that a loaded machine's
    test still signals while it runs: one that lands after it made a second checkpoint)."""
    return ("--every", "1000", "--no-epoch-checkpoint", *SLOW, *(("--val-epoch-slow", "1.0") if phase == "validation" else ()))


def wait_for_phase(out_dir: pathlib.Path, phase: str, job: subprocess.Popen, ranks: int = 2) -> None:
    if phase == "validation":
        helpers.wait_for(lambda: all((out_dir / f"validated-{rank}").exists() for rank in range(ranks)), "validation", job)
    else:
        helpers.wait_for(lambda: min(helpers.splits_done(out_dir, rank) for rank in range(ranks)) >= 2, "training", job)


def send(job: subprocess.Popen, target: str, number: int, times: int) -> set[int]:
    """Signal ``job`` (started in a session of its own) ``times`` times in quick succession;
    the processes of the job when the first signal went out."""
    job_processes = {job.pid} | descendants(job.pid)
    for _ in range(times):
        if target == "launcher":
            os.kill(job.pid, number)
        elif target == "group":
            os.killpg(job.pid, number)
        else:
            for pid in {job.pid} | descendants(job.pid):
                _kill_if_alive(pid, number)
        time.sleep(0.05)
    return job_processes


def _kill_if_alive(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def alive(pids: set[int]) -> set[int]:
    table = process_table()
    return {pid for pid in pids if pid in table and table[pid][1] not in ZOMBIE_STATES}


def committed(run_dir: pathlib.Path) -> list[str]:
    return [info.name for info in CheckpointStore(Storage(str(run_dir)), create=False).inspect() if info.valid]


def launch_directories(temp_dir: pathlib.Path) -> list[pathlib.Path]:
    """What launchers using ``temp_dir`` as TMPDIR left (their marker lives in it)."""
    return list(temp_dir.glob("splitloop-launch-*"))


__all__ = ["signal"]
