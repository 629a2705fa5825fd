"""Preemption agreed across ranks in every phase, under a real torchrun (gloo, CPU, 3 ranks):
the signal reaches one rank only, while the ranks train, validate or commit a checkpoint. Every
rank stops at the same boundary, one checkpoint is committed there, ``python -m engine launch``
exits 75, and the resumed job equals one never interrupted, bit for bit (every rank's
parameters, RNG and carried hidden state, and metrics.jsonl)."""

from __future__ import annotations

import json
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest

from engine.checkpoint.storage import Storage
from engine.checkpoint.store import CheckpointStore

import torchrun_helpers as helpers

pytestmark = pytest.mark.slow

RANKS = 3
# One epoch of 12 splits per rank, a step every 2 splits, a validation pass (4 batches) every 2
# steps; no periodic checkpoint: the checkpoints are those after validations and the stop's.
OPTIONS = ("--epochs", "1", "--every", "1000", "--validate-every", "2", "--val-workers", "1")
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
    # Each worker says where it stopped: the same checkpoint, at the same cursor, on every rank.
    stops = {line.partition("; checkpoint ")[2] for line in stderr.splitlines() if line.startswith("splitloop: ")}
    reported = [line for line in stderr.splitlines() if line.startswith("splitloop: ")]
    assert len(reported) == RANKS and len(stops) == 1, stderr[-4000:]
    stop_name = stops.pop().split(" ")[0]
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
    process = helpers.run(helpers.torchrun_command(RANKS, job / "run", job / "out", *OPTIONS), helpers.environment())
    assert process.returncode == 0, process.stderr[-4000:]
    helpers.assert_same_result(reference, job, RANKS)


def preempt_by_fault_point(reference: pathlib.Path, job: pathlib.Path, kills: str) -> None:
    with launch(job, KILLS=kills) as process:
        _, stderr = process.communicate(timeout=helpers.TIMEOUT)
    assert_one_stop_and_one_checkpoint_for_it(job, process.returncode, stderr)
    resume_and_compare(reference, job)


def test_sigterm_to_one_rank_inside_validation(reference: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # Rank 2 is signalled after the second batch of the second validation pass; the others are
    # validating too, or already waiting at the boundary that follows.
    preempt_by_fault_point(reference, tmp_path / "job", "0/2/validation_batch_end:6:sigterm")


@pytest.mark.exhaustive
@pytest.mark.parametrize("kills", [
    "0/0/checkpoint_before_rename:1:sigterm",  # rank 0 inside the first commit, the others waiting for it
    "0/0/checkpoint_before_file:2:sigterm",  # rank 0 starting the second commit
    "0/1/validation_batch_end:1:sigterm",  # rank 1 in the first validation batch of the run
    "0/2/validation_batch_end:12:sigterm",  # rank 2 at the end of the last pass (the epoch's end)
], ids=["in-commit", "commit-start", "first-validation-batch", "last-validation-batch"])
def test_sigterm_to_one_rank_at_fault_points(reference: pathlib.Path, tmp_path: pathlib.Path, kills: str) -> None:
    preempt_by_fault_point(reference, tmp_path / "job", kills)


@pytest.mark.exhaustive
@pytest.mark.parametrize("seed", range(6))
def test_sigterm_to_one_rank_at_a_random_instant(reference: pathlib.Path, tmp_path: pathlib.Path, seed: int) -> None:
    rng = random.Random(seed)
    rank, delay = rng.randrange(RANKS), rng.uniform(0.0, 1.2)
    job = tmp_path / "job"
    with launch(job, *SLOW) as process:
        helpers.wait_for(lambda: min(helpers.splits_done(job / "out", r) for r in range(RANKS)) >= 1,
                         "every rank trains (its signal handlers are installed)", process)
        time.sleep(delay)
        helpers.signal_worker(job / "out", rank, signal.SIGTERM)
        _, stderr = process.communicate(timeout=helpers.TIMEOUT)
    if process.returncode == 0:  # the signal came after the last boundary: nothing was stopped
        assert "splitloop: " not in stderr
    else:
        assert_one_stop_and_one_checkpoint_for_it(job, process.returncode, stderr)
        resume_and_compare(reference, job)
