"""Each LightningModule of lit_modules (an autoencoder, the same with ModelCheckpoint(save_top_k=2)
and EarlyStopping, a manual-optimization GAN, a Lightning 1.x TBPTT module, a GRU language model
with ReduceLROnPlateau monitoring val_loss; Lightning's demo BoringModel and LightningTransformer,
and modules in the shape of Lightning's basics examples), trained through engine.lightning.Trainer in real
processes that are SIGKILLed at random instants (random fault points and arrival counts: inside
steps, between backward and step, at split ends, inside validation, inside checkpoint writes) and
started again until one finishes: its weights, optimizer and scheduler state, every row of
metrics.jsonl, the callbacks' state (hyperparameters and early stopping included), its best
checkpoints and (GRU model) its TensorBoard scalars and CSV log equal those of a run never
interrupted."""

from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
import sys

import forkserver
import pytest
import torch

from loggers.test_loggers import assert_same_logs
from kill_helpers import killed_at_the_fault
from resume_helpers import assert_same_run
from engine.checkpoint.storage import Storage
from engine.checkpoint.store import CheckpointStore

SCRIPT = str(pathlib.Path(__file__).with_name("lit_scenarios.py"))
TIMEOUT = 180
NAMES = ("autoencoder", "checkpointed", "gan", "tbptt", "gru_lm")
TRAINING_POINTS = ("step_start", "after_backward", "after_optimizer_step", "split_end", "split_end_after_checkpoint",
                   "epoch_end", "checkpoint_before_manifest", "checkpoint_after_rename")

pytestmark = pytest.mark.slow


def train(name, run_dir, faults=None):
    env = dict(os.environ)
    env.pop("SPLITLOOP_FAULTS", None)
    if faults:
        env["SPLITLOOP_FAULTS"] = faults
    return forkserver.run([sys.executable, SCRIPT, name, run_dir], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)


def random_fault(name, rng, kills_so_far):
    """A random fault point and arrival; a module that validates is killed inside validation first."""
    if name == "gan":  # manual optimization: the engine runs no backward of its own
        point = rng.choice([point for point in TRAINING_POINTS if point != "after_backward"])
    elif name == "transformer":  # no validation
        point = rng.choice(TRAINING_POINTS)
    else:
        point = "validation_batch_end" if kills_so_far == 0 else rng.choice(TRAINING_POINTS + ("validation_batch_end",))
    # An epoch ends only a few times in a run: an arrival past the end would never kill.
    return f"{point}:{rng.randint(1, 2 if point == 'epoch_end' else 6)}:sigkill"


def best_checkpoints(run_dir):
    """The kept best checkpoints by content: cursor, recorded value, model tensors."""
    store = CheckpointStore(Storage(run_dir))
    return [(loaded.progress.cursor, loaded.manifest.monitor, loaded.state["module"])
            for loaded in (store.load(name) for name in store.best(2))]


def assert_same_best(reference, run_dir):
    expected, actual = best_checkpoints(reference), best_checkpoints(run_dir)
    assert [e[:2] for e in expected] == [a[:2] for a in actual]
    for (_, _, a), (_, _, b) in zip(expected, actual):
        assert all(torch.equal(a[key], b[key]) for key in a)


class References(dict):
    """Each module's uninterrupted run, trained when a test first asks for it."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self._tmp_path_factory = tmp_path_factory

    def __missing__(self, name):
        run_dir = str(self._tmp_path_factory.mktemp(f"reference-{name}"))
        process = train(name, run_dir)
        assert process.returncode == 0, process.stderr[-3000:]
        self[name] = run_dir
        return run_dir


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return References(tmp_path_factory)


def kill_and_resume(name, run_dir, rng, kills_wanted):
    """Start the training again and again, armed with a random fault until ``kills_wanted``
    kills, until a process finishes; returns the kills (a fault drawn past the run's end lets
    it finish early; with a writer process a checkpoint_* point kills that process, and the
    training process, which starts another, finishes)."""
    kills = 0
    for _ in range(kills_wanted + 2):
        process = train(name, run_dir, random_fault(name, rng, kills) if kills < kills_wanted else None)
        assert process.returncode in (0, -signal.SIGKILL), process.stderr[-3000:]
        if process.returncode == 0:
            return kills + killed_at_the_fault(process.returncode, process.stderr)
        kills += 1
    raise AssertionError(f"{name}: {kills} kills, no finished run")


def check_kills(references, name, tmp_path, seed, kills_wanted):
    run_dir = str(tmp_path / "run")
    assert kill_and_resume(name, run_dir, random.Random(f"{name}-{seed}"), kills_wanted) >= 1
    assert_same_run(references[name], run_dir)
    if name == "checkpointed":
        assert len(best_checkpoints(run_dir)) == 2
        assert_same_best(references[name], run_dir)
    if name == "example_autoencoder":  # configure_callbacks' ModelCheckpoint(save_top_k=1)
        assert len(best_checkpoints(run_dir)) == 1
        assert_same_best(references[name], run_dir)
    if name == "gru_lm":  # TensorBoard scalars and the CSV hold every step once, as uninterrupted
        assert_same_logs(references[name], run_dir)


# Lightning's demos unchanged, and modules in the shape of Lightning's basics examples (predict_step,
# self.log(on_step=True) in validation_step, test and validation-batch hooks, configure_callbacks).
# By default the demo whose overrides the adapter used to skip, and the basics shape with every new
# hook; the transformer and the classifier (the same hooks) are killed in the exhaustive run.
EXAMPLES = ("boring", "transformer", "example_autoencoder", "classifier")
# One kill each by default (CI time); the exhaustive run kills each run 4 to 6 times.
DEFAULT_KILLS = [(name, 1) for name in NAMES] + [("boring", 1), ("example_autoencoder", 1)]
MANY_KILLS = ([(name, seed, 6) for seed in range(1, 6) for name in NAMES]
              + [(name, seed, 4) for seed in range(1, 4) for name in EXAMPLES])


@pytest.mark.parametrize("name, kills_wanted", DEFAULT_KILLS)
def test_sigkilled_at_random_instants_the_resumed_run_equals_an_uninterrupted_one(references, name, kills_wanted,
                                                                                   tmp_path):
    check_kills(references, name, tmp_path, seed=0, kills_wanted=kills_wanted)


@pytest.mark.exhaustive
@pytest.mark.parametrize("name, seed, kills_wanted", MANY_KILLS)
def test_many_random_kills(references, name, seed, kills_wanted, tmp_path):
    check_kills(references, name, tmp_path, seed, kills_wanted)


def test_a_preempted_run_exits_to_be_requeued_and_resumes_to_the_uninterrupted_one(references, tmp_path):
    run_dir = str(tmp_path / "run")
    preempted = train("checkpointed", run_dir, "validation_batch_end:2:sigterm")  # the signal lands in validation
    assert preempted.returncode == 75 and "checkpoint ckpt-" in preempted.stderr, preempted.stderr[-3000:]
    assert train("checkpointed", run_dir).returncode == 0
    assert_same_run(references["checkpointed"], run_dir)
    assert_same_best(references["checkpointed"], run_dir)
