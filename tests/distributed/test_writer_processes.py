"""The writer processes of a torchrun job (engine.distributed.writer_processes) end with their
training processes: one whose training process is gone leaves at once, even from inside a
collective of its group that would wait for another writer process for the group's timeout
(30 minutes), holding the lease's lock all that time."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time

import torchrun_helpers as helpers
from process_table import writer_processes_of


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it ended, its parent has not reaped it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def test_a_writer_process_whose_training_process_died_leaves_even_from_inside_a_collective(
        tmp_path: pathlib.Path) -> None:
    run_dir, out_dir = tmp_path / "job" / "run", tmp_path / "job" / "out"
    out_dir.mkdir(parents=True)
    command = helpers.torchrun_command(2, run_dir, out_dir, "--writer", "process", "--slow", "0.1")
    job = subprocess.Popen(command, env=helpers.environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    stopped: list[int] = []
    try:
        helpers.wait_for(lambda: helpers.splits_done(out_dir, 1) >= 3, "training started", job)
        trainers = [helpers.worker_pid(out_dir, rank) for rank in range(2)]
        assert None not in trainers
        writers = [writer_processes_of(pid) for pid in trainers]  # type: ignore[arg-type]
        assert [len(pids) for pids in writers] == [1, 1], writers
        (rank_0_writer,), (rank_1_writer,) = writers
        # Rank 1's writer process stopped: rank 0's waits for it in its next checkpoint's gather.
        os.kill(rank_1_writer, signal.SIGSTOP)
        stopped.append(rank_1_writer)
        time.sleep(1.5)
        assert alive(rank_0_writer)
        os.kill(trainers[0], signal.SIGKILL)  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while alive(rank_0_writer) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(rank_0_writer), "rank 0's writer process outlived its training process by 10 s"
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        helpers.kill_node(job)  # torchrun, its workers (each in a session of its own) and theirs
