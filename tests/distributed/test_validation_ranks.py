"""Validation split across the ranks of a torchrun job, values reduced across ranks
(``self.log(..., sync=True)`` in training, every validation value), and a job of two "nodes" (two
torchrun agents on this machine) that loses a whole node and is restarted.

The validation set has 10 samples in batches of 2: 5 batches, 3 on rank 0 and 2 on rank 1."""

from __future__ import annotations

import json
import pathlib
import random
import subprocess
import sys
import time

import pytest

from engine.checkpoint.storage import Storage
from engine.checkpoint.store import CheckpointStore

import torchrun_helpers as helpers
import dist_train  # noqa: E402 - after the helpers: it takes its own folder off sys.path

pytestmark = pytest.mark.slow

VALIDATION_SAMPLES = 10
# No hidden state carried across batches: with it the validation batches are one sequence, which
# rank 0 validates whole.
OPTIONS = ("--epochs", "1", "--validate-every", "2", "--val-samples", str(VALIDATION_SAMPLES), "--log-values",
           "--no-carry")
SPLITS_PER_BATCH = dist_train.TIME // dist_train.SPLIT  # validation_step runs once per TBPTT split


def rows(run_dir: pathlib.Path, stage: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row.get("stage") == stage]


def validated_batches(run_dir: pathlib.Path) -> int:
    """The validation batches the newest checkpoint counts (replicated progress)."""
    loaded = CheckpointStore(Storage(str(run_dir)), create=False).latest()
    assert loaded is not None
    return loaded.progress.records["evaluation.batches"].total.completed


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """An uninterrupted 2-rank job (one torchrun agent)."""
    return helpers.uninterrupted(tmp_path_factory.mktemp("reference"), 2, *OPTIONS)


def test_training_values_logged_with_sync_are_reduced_across_ranks(reference: pathlib.Path) -> None:
    train = rows(reference / "run", "train")
    assert train
    for row in train:
        # One value per rank and split, "mean": the same sum in rank order as the loss's mean.
        assert row["metrics"]["synced_loss"] == row["loss"], row
        assert row["metrics"]["samples"] == 2 * dist_train.BATCH, row  # "sum" over both ranks' batches
    # Without sync each rank keeps its own value (rank 0's is written).
    assert any(row["metrics"]["own_loss"] != row["loss"] for row in train)


def test_validation_is_split_across_ranks_and_equals_a_single_process(tmp_path: pathlib.Path) -> None:
    # lr=0: the weights stay the initial ones, so one process validates with the same weights.
    options = (*OPTIONS, "--lr", "0")
    process, run_dir, out_dir = helpers.train(tmp_path, "ranks", 2, *options)
    assert process.returncode == 0, process.stderr[-4000:]
    alone_run, alone_out = tmp_path / "alone" / "run", tmp_path / "alone" / "out"
    alone_out.mkdir(parents=True)
    alone = subprocess.run([sys.executable, helpers.SCRIPT, str(alone_run), str(alone_out), *options],
                           env=helpers.environment(), capture_output=True, text=True, timeout=helpers.TIMEOUT)
    assert alone.returncode == 0, alone.stderr[-4000:]
    validations, alone_validations = rows(run_dir, "val"), rows(alone_run, "val")
    for row in validations:
        assert row["metrics"]["val_samples"] == VALIDATION_SAMPLES * SPLITS_PER_BATCH, row  # each sample once
    # The single process trains on both ranks' data, so it validates more often; its first passes
    # are the job's (same weights, same pass seeds). Each rank's batches, in rank order, are the
    # single process's, so the values are the same, bit for bit.
    passes, batches = len(validations), VALIDATION_SAMPLES // dist_train.BATCH
    assert 2 <= passes < len(alone_validations)
    assert [row["metrics"] for row in validations] == [row["metrics"] for row in alone_validations[:passes]]
    assert validated_batches(run_dir) == passes * batches
    assert validated_batches(alone_run) == len(alone_validations) * batches
    calls = [int((out_dir / f"validation-calls-{rank}").read_text()) for rank in (0, 1)]
    assert calls == [passes * 3 * SPLITS_PER_BATCH, passes * 2 * SPLITS_PER_BATCH]  # uneven: rank 0 one batch more
    # In a single process sync=True changes nothing.
    for row in rows(alone_run, "train"):
        assert row["metrics"]["synced_loss"] == row["metrics"]["own_loss"] == row["loss"], row
        assert row["metrics"]["samples"] == dist_train.BATCH


def test_two_nodes_one_killed_whole_and_the_job_restarted_resume_exactly(reference: pathlib.Path,
                                                                         tmp_path: pathlib.Path) -> None:
    rng = random.Random()
    # Early in the job (a kill after its last commit leaves the resumed job nothing to train).
    victim, delay = rng.randrange(2), rng.uniform(0.0, 0.5)
    job = tmp_path / "job"
    # Ranks forked through the relay (CI time: no fresh torch per rank): a killed node's relays
    # take their training processes with them (the fork server SIGKILLs them).
    agents = helpers.start_nodes(job, *OPTIONS, "--slow", "0.1", forked_ranks=True)
    try:
        helpers.wait_for(lambda: helpers.metrics_lines(job / "run") >= 2, "training started", agents[0])
        time.sleep(delay)
        helpers.kill_node(agents[victim])
        # The other node's worker fails at its next collective; with no restarts its agent ends.
        survivor = agents[1 - victim]
        assert survivor.wait(timeout=helpers.TIMEOUT) != 0, helpers.node_logs(job)
    finally:
        for agent in agents:
            if agent.poll() is None:
                helpers.kill_node(agent)
    # The scheduler starts the job again: both agents.
    restarted = helpers.start_nodes(job, *OPTIONS, forked_ranks=True)
    statuses = [agent.wait(timeout=helpers.TIMEOUT) for agent in restarted]
    assert statuses == [0, 0], f"node {victim} killed after {delay:.2f}s: " + helpers.node_logs(job)
    helpers.assert_same_result(reference, job, 2)
