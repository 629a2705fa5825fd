"""Fault tolerance proven by killing real processes (SIGKILL), resuming, and comparing with
the uninterrupted run bit for bit: final model, optimizers, schedulers, RNG, progress and
metrics.jsonl (see resume_helpers.assert_same_run)."""

import os
import random

import pytest

from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from progress import Cursor
from kill_helpers import kill_at_random_instant, killed_at_the_fault, run_scenario, run_until_done
from resume_helpers import assert_same_run
from scenarios import train_with_checkpoints

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted runs, trained once per scenario (in process: same threads, same numbers)."""
    cache = {}

    def reference(name, epochs=2):
        key = (name, epochs)
        if key not in cache:
            run_dir = str(tmp_path_factory.mktemp(f"reference-{name}-{epochs}"))
            train_with_checkpoints(name, run_dir, epochs=epochs)
            cache[key] = run_dir
        return cache[key]

    return reference


def test_kill_right_after_each_split_boundary(tmp_path, references):
    """Each process completes one more split (its checkpoint committed) and is killed; 2 epochs
    x 3 batches x 4 splits with shuffled data and dropout -> 24 kills, one per boundary."""
    run_dir = str(tmp_path / "run")
    kills = run_until_done("tbptt", run_dir, "split_end_after_checkpoint:1:sigkill")
    assert kills >= 24
    assert_same_run(references("tbptt"), run_dir)


def test_kill_before_the_boundary_checkpoint(tmp_path, references):
    """Killed after a split ran but before its checkpoint (every third split of a process):
    that split runs again, its metrics line is written once."""
    run_dir = str(tmp_path / "run")
    kills = run_until_done("tbptt", run_dir, "split_end:3:sigkill")
    assert kills >= 8
    assert_same_run(references("tbptt"), run_dir)


def test_kill_at_epoch_end(tmp_path, references):
    """Killed at an epoch end before its checkpoint: the resumed process redoes the end of that
    epoch (arrival 1 survives) and dies at the next one (arrival 2)."""
    run_dir = str(tmp_path / "run")
    kills = run_until_done("tbptt", run_dir, "epoch_end:2:sigkill", "--epochs", "3")
    assert kills == 2
    assert_same_run(references("tbptt", epochs=3), run_dir)


# CI time: manual optimization and accumulation over whole batches in the exhaustive run (an open
# accumulation window across a kill stays by default, with accumulate_splits).
@pytest.mark.parametrize("name", ["accumulate_splits", "tbptt_several_optimizers", "carried_hidden", "plain"]
                         + [pytest.param(name, marks=pytest.mark.exhaustive) for name in ("manual", "accumulate_batches")])
def test_kill_every_few_boundaries(name, tmp_path, references):
    run_dir = str(tmp_path / "run")
    kills = run_until_done(name, run_dir, "split_end_after_checkpoint:6:sigkill")
    assert kills >= 1
    assert_same_run(references(name), run_dir)


def test_kill_with_asynchronous_checkpoints(tmp_path, references, test_writer):
    """SIGKILL while background writes are queued or in progress: a lost write only means an
    older resume point; the result is still exact. Each process dies midway through writing its
    fourth checkpoint (the writer is sequential, so three committed: every process moves the run
    forward however slow the disk is next to training). With a writer process, that process is
    the one killed there; the training process starts another (not armed) and ends the run."""
    run_dir = str(tmp_path / "run")
    kills = run_until_done("tbptt", run_dir, "checkpoint_before_manifest:4:sigkill", "--async")
    assert kills >= (1 if test_writer == "process" else 5)
    assert_same_run(references("tbptt"), run_dir)


def test_kill_at_random_instants(tmp_path, references):
    """At least 10 SIGKILLs at random instants of training (mid-step, mid-checkpoint-write,
    mid-retention), each followed by a resume; the final state is bit-exact."""
    kill_at_random_instants_until(tmp_path, references, kills_wanted=10, seed=20261129)


@pytest.mark.exhaustive
def test_kill_at_random_instants_many_times(tmp_path, references):
    kill_at_random_instants_until(tmp_path, references, kills_wanted=40, seed=20261202)


def kill_at_random_instants_until(tmp_path, references, kills_wanted, seed):
    """Runs killed at random instants within 0.8 s of their start and resumed until they end,
    until ``kills_wanted`` kills; each run ends bit-exact."""
    rng = random.Random(seed)
    kills = 0
    runs = 0
    while kills < kills_wanted:
        run_dir = str(tmp_path / f"run{runs}")
        runs += 1
        while not finished(run_dir, epochs=6):
            if kill_at_random_instant("tbptt", run_dir, rng, 0.8, "--epochs", "6"):
                kills += 1
        assert_same_run(references("tbptt", epochs=6), run_dir)
    assert kills >= kills_wanted


def finished(run_dir, epochs):
    """Whether the run's newest valid checkpoint has every epoch completed."""
    if not os.path.isdir(os.path.join(run_dir, "checkpoints")):
        return False
    latest = CheckpointStore(Storage(run_dir)).latest()
    return latest is not None and latest.progress.records["fit.epochs"].total.completed == epochs


COMMIT_STEPS = [
    "checkpoint_before_file:13:sigkill",   # 5th checkpoint, before tensors.bin
    "checkpoint_after_file:14:sigkill",    # 5th checkpoint, after state.msgpack
    "checkpoint_after_file:15:sigkill",    # 5th checkpoint, after progress.msgpack
    "checkpoint_before_manifest:5:sigkill",
    "checkpoint_before_rename:5:sigkill",
    "checkpoint_after_rename:5:sigkill",
    "checkpoint_retention:2:sigkill",
]


@pytest.mark.parametrize("fault", COMMIT_STEPS)
def test_kill_inside_the_commit_protocol(fault, tmp_path, references):
    """A kill between any two steps of a checkpoint write leaves the previous checkpoint
    loadable, and the resumed run is exact. With a writer process, the writer is the process
    killed there: the training process starts another, which commits what its slots still
    hold, and ends the run; the run is exact."""
    run_dir = str(tmp_path / "run")
    process = run_scenario("tbptt", run_dir, fault)
    assert killed_at_the_fault(process.returncode, process.stderr), process.stderr[-2000:]
    store = CheckpointStore(Storage(run_dir))
    latest = store.latest()
    assert latest is not None
    if process.returncode == -9:  # the training process wrote and died there
        committed = fault.startswith(("checkpoint_after_rename", "checkpoint_retention"))
        # the 5th checkpoint is batch 1, split 0 (batch 0 has splits 0-3); the 4th is batch 0, split 3
        assert latest.progress.cursor == (Cursor(0, 1, 0, 0) if committed else Cursor(0, 0, 3, 0))
    result = train_with_checkpoints("tbptt", run_dir)
    assert result.resumed_from == latest.name
    assert_same_run(references("tbptt"), run_dir)


# The same kills with checkpoints written by a writer process (CheckpointConfig(writer="process")):
# the training process is SIGKILLed, its writer process commits what it received and exits, the
# restart waits for it. A representative case by default; the rest of the matrix is exhaustive.
WRITER_PROCESS_KILLS = [
    ("tbptt", "split_end_after_checkpoint:6:sigkill", 2),
    *[pytest.param(name, fault, epochs, marks=pytest.mark.exhaustive) for name, fault, epochs in [
        ("tbptt", "split_end:3:sigkill", 2),
        ("tbptt", "split_end_after_checkpoint:1:sigkill", 2),
        ("tbptt", "epoch_end:2:sigkill", 3),
        *[(name, "split_end_after_checkpoint:6:sigkill", 2) for name in
          ["accumulate_splits", "manual", "tbptt_several_optimizers", "carried_hidden", "accumulate_batches", "plain"]],
    ]],
]


@pytest.mark.exhaustive  # tests/checkpoint/writers/test_writer_process.py kills the trainer and the writer by default
@pytest.mark.parametrize("name, fault, epochs", WRITER_PROCESS_KILLS)
def test_kill_with_a_writer_process(name, fault, epochs, tmp_path, references):
    run_dir = str(tmp_path / "run")
    kills = run_until_done(name, run_dir, fault, "--writer", "process", "--epochs", str(epochs))
    assert kills >= 1
    assert_same_run(references(name, epochs=epochs), run_dir)


@pytest.mark.exhaustive
def test_kill_at_random_instants_with_a_writer_process(tmp_path, references):
    """SIGKILLs of the training process at random instants while a writer process writes: the
    restart waits for that process to finish, the final state is bit-exact."""
    rng = random.Random(20261201)
    kills = 0
    runs = 0
    while kills < 8:  # runs until 8 kills: how many a run takes depends on the machine's speed
        run_dir = str(tmp_path / f"run{runs}")
        runs += 1
        while not finished(run_dir, epochs=6):
            if kill_at_random_instant("tbptt", run_dir, rng, 0.8, "--epochs", "6", "--writer", "process"):
                kills += 1
        assert_same_run(references("tbptt", epochs=6), run_dir)
