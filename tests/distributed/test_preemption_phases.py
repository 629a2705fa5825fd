"""Preemption agreed across ranks in every phase, under a real torchrun (gloo, CPU, 3 ranks):
the signal reaches one rank only, while the ranks train, validate or commit a checkpoint. Every
rank stops at the same boundary, one checkpoint is committed there, ``python -m engine launch``
exits 75, and the resumed job equals one never interrupted, bit for bit (every rank's
parameters, RNG and carried hidden state, and metrics.jsonl)."""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore

import torchrun_helpers as helpers

pytestmark = pytest.mark.slow

RANKS = 3
# One epoch of 12 splits per rank, a step every 2 splits, a validation pass every 2 steps; no
# periodic checkpoint: the checkpoints are those after validations and the stop's. No hidden state
# carried across batches, so the 4 validation batches of a pass are split across the ranks: 2 on
# rank 0, 1 on rank 1, 1 on rank 2 (3 splits each).
OPTIONS = ("--epochs", "1", "--every", "1000", "--validate-every", "2", "--val-workers", "1", "--no-carry")
SLOW = ("--slow", "0.03", "--val-slow", "0.03")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    tmp = tmp_path_factory.mktemp("reference")
    process, _, _ = helpers.train(tmp, "job", RANKS, *OPTIONS)
    assert process.returncode == 0, process.stderr[-4000:]
    return tmp / "job"


def launch(job: pathlib.Path, *options: str, **env: str) -> subprocess.Popen:
    """``python -m engine launch`` over torchrun, as a batch script starts the job."""
    run_dir, out_dir = job / "run", job / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "engine", "launch", "--marker", str(job / "marker.json"), "--",
               *helpers.torchrun_command(RANKS, run_dir, out_dir, *OPTIONS, *options)]
    return subprocess.Popen(command, env=helpers.environment(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=helpers.REPOSITORY)


def assert_one_stop_and_one_checkpoint_for_it(job: pathlib.Path, status: int, stderr: str) -> None:
    assert status == 75, stderr[-4000:]
    # Each worker says where it stopped: the same checkpoint, at the same cursor, on every rank
    # (the workers share stderr: a line may run into another one).
    reported = re.findall(r"splitloop: preempted[^;]*; checkpoint (\S+) committed at ([^;]+); exiting with 0", stderr)
    assert len(reported) == RANKS and len(set(reported)) == 1, stderr[-4000:]
    stop_name = reported[0][0]
    store = CheckpointStore(Storage(str(job / "run")), create=False)
    infos = store.inspect()
    assert all(info.valid for info in infos) and infos[-1].name == stop_name
    # No boundary is committed twice; every checkpoint but the stop's follows a validation.
    cursors = [info.cursor.as_tuple() for info in infos]
    assert len(set(cursors)) == len(cursors)
    rows = [json.loads(line) for line in (job / "run" / "metrics.jsonl").read_text().splitlines()]
    validated = {(row["epoch"], row["batch"], row["split"]) for row in rows if row.get("stage") == "val"}
    assert all(cursor[:3] in validated for cursor in cursors[:-1]), (cursors, validated)
    last_row = rows[-1]
    assert (last_row["epoch"], last_row["batch"], last_row["split"]) == cursors[-1][:3]  # no work lost


def resume_and_compare(reference: pathlib.Path, job: pathlib.Path) -> None:
    process = helpers.run(helpers.torchrun_command(RANKS, job / "run", job / "out", *OPTIONS, forked_ranks=True),
                          helpers.environment())
    assert process.returncode == 0, process.stderr[-4000:]
    helpers.assert_same_result(reference, job, RANKS)


def child_processes(pid: int) -> list[int]:
    children: list[int] = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        children += [int(child) for child in (task / "children").read_text().split()]
    return children


@pytest.mark.exhaustive  # loader workers under a signal: run/test_preemption_validation; one rank's SIGTERM: test_torchrun
@pytest.mark.skipif(not pathlib.Path("/proc/self/task").exists(), reason="needs Linux /proc to find DataLoader workers")
def test_sigterm_to_one_rank_and_its_loader_workers_while_it_validates(reference: pathlib.Path,
                                                                       tmp_path: pathlib.Path) -> None:
    # Rank 2 pauses in the last split of its batch of the second validation pass; it and its
    # validation DataLoader worker get SIGTERM (as SLURM signals every process of a job step), the other
    # ranks validate or already wait at the boundary that follows the pass.
    job = tmp_path / "job"
    with launch(job, VALIDATION_PAUSE="2/6") as process:
        helpers.wait_for(lambda: (job / "out" / "validating-2").exists(), "rank 2 validating", process)
        rank = helpers.worker_pid(job / "out", 2)
        assert rank is not None
        workers = child_processes(rank)
        assert workers, "rank 2 has no validation DataLoader worker"
        for pid in (rank, *workers):
            os.kill(pid, signal.SIGTERM)
        (job / "out" / "go").write_text("")
        _, stderr = process.communicate(timeout=helpers.TIMEOUT)
    assert "killed by signal" not in stderr
    assert_one_stop_and_one_checkpoint_for_it(job, process.returncode, stderr)
    resume_and_compare(reference, job)


@pytest.mark.exhaustive
@pytest.mark.parametrize("kills", [
    "0/0/validation_batch_end:3:sigterm",  # rank 0 (alone, not its workers) inside the second pass
    "0/0/checkpoint_before_rename:1:sigterm",  # rank 0 inside the first commit, the others waiting for it
    "0/0/checkpoint_before_file:2:sigterm",  # rank 0 starting the second commit
    "0/1/validation_batch_end:1:sigterm",  # rank 1 in the first validation batch of the run
    "0/2/validation_batch_end:2:sigterm",  # rank 2 after the last batch of the second pass
], ids=["in-validation", "in-commit", "commit-start", "first-validation-batch", "end-of-a-pass"])
def test_sigterm_to_one_rank_at_fault_points(reference: pathlib.Path, tmp_path: pathlib.Path, kills: str) -> None:
    job = tmp_path / "job"
    with launch(job, KILLS=kills) as process:
        _, stderr = process.communicate(timeout=helpers.TIMEOUT)
    assert_one_stop_and_one_checkpoint_for_it(job, process.returncode, stderr)
    resume_and_compare(reference, job)


@pytest.mark.exhaustive
@pytest.mark.parametrize("seed", range(6))
def test_sigterm_to_one_rank_at_a_random_instant(reference: pathlib.Path, tmp_path: pathlib.Path, seed: int) -> None:
    rng = random.Random(seed)
    # Within the first half of the job even on a fast machine (a slower one only moves the signal
    # earlier in the job): a stop in the last pass leaves the resumed job no split to train, and
    # dist_train.py reads the final hidden state from a training step.
    rank, delay = rng.randrange(RANKS), rng.uniform(0.0, 0.5)
    asynchronous = ("--async",) if seed % 2 else ()  # checkpoints written in the background
    job = tmp_path / "job"
    with launch(job, *SLOW, *asynchronous) as process:
        helpers.wait_for(lambda: min(helpers.splits_done(job / "out", r) for r in range(RANKS)) >= 1,
                         "every rank trains (its signal handlers are installed)", process)
        time.sleep(delay)
        helpers.signal_worker(job / "out", rank, signal.SIGTERM)
        _, stderr = process.communicate(timeout=helpers.TIMEOUT)
    assert_one_stop_and_one_checkpoint_for_it(job, process.returncode, stderr)
    resume_and_compare(reference, job)
