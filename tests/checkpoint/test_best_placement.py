"""A best-checkpoint record lands on the weights it was computed on, and is never lost:

* with ``writer="thread", when_behind="skip"`` a snapshot that records a validation's value is
  neither skipped nor superseded (it replaces a queued snapshot that records none, or waits for
  a buffer), and no later checkpoint inherits its value;
* after a SIGKILL, a candidate the fast tier alone holds still reaches the run dir;
* a validation at an epoch end without ``at_epoch_end`` checkpoints gets a checkpoint of its own;
* with a fast local tier, a candidate best checkpoint always reaches the durable tier (where
  ``inspect`` and ``load_weights(checkpoint="best")`` find it) and its retention keeps it.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import threading
import types

import pytest
import torch

import engine
from engine.checkpoint.writers import writer as writer_module
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.cli.commands import inspect_run
import forkserver
from kill_helpers import TIMEOUT, environment
from validation_scenarios import best_policy as best_policy_of_the_script
from validation_scenarios import build_validated, fast_tier_policy, kept_best, train_validated

SCRIPT = str(pathlib.Path(__file__).parent.parent / "validation_scenarios.py")

# 12 splits (= optimizer steps) per epoch: validations at steps 5, 10, 15 and 20, none at an
# epoch end, so the last validation is followed by training before the run's last checkpoint.
VALIDATION = dict(epochs=2, every_steps=5, val_at_epoch_end=False)


def val_rows(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [row for row in rows if row["stage"] == "val"]


def position(row):
    return row["epoch"], row["batch"], row["split"]


def monitored_checkpoints(run_dir):
    """{(epoch, batch, split): monitored value} of every checkpoint that records one."""
    store = CheckpointStore(Storage(run_dir))
    found = {}
    for name in store.names():
        loaded = store.load(name)
        if loaded.manifest.monitor is not None:
            cursor = loaded.progress.cursor
            found[(cursor.epoch, cursor.batch, cursor.split)] = loaded.manifest.monitor.value
    return found


def assert_every_record_on_its_validation(run_dir):
    """Each validation's value is recorded by exactly the checkpoint of its boundary."""
    expected = {position(row): row["metrics"]["val_loss"] for row in val_rows(run_dir)}
    assert expected
    assert monitored_checkpoints(run_dir) == expected


def assert_best_weights_equal(run_dir, reference_dir):
    """load_weights(checkpoint="best") gives the reference run's best weights, taken at the
    same boundary (the two runs train identically)."""
    model, reference = build_validated()[0], build_validated()[0]
    name = engine.load_weights(model, run_dir, checkpoint="best")
    reference_name = engine.load_weights(reference, reference_dir, checkpoint="best")
    cursor = CheckpointStore(Storage(run_dir)).load(name).progress.cursor
    assert cursor == CheckpointStore(Storage(reference_dir)).load(reference_name).progress.cursor
    for key, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], tensor), key


def best_policy(**overrides):
    settings = dict(every_n_splits=1, keep_last=None, monitor="val_loss", mode="min", keep_best=1)
    settings.update(overrides)
    return engine.CheckpointConfig(**settings)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Synchronous, every split: every validation's checkpoint is written."""
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_validated(run_dir, checkpoint=best_policy(), **VALIDATION)
    assert_every_record_on_its_validation(run_dir)
    return run_dir


def hold_writes_until_training_waits(monkeypatch):
    """Every checkpoint write waits until the training thread waits for the background writer
    (for a buffer, or for the last writes): whenever a validation boundary takes its snapshot,
    the writer is still busy with an earlier one. Deterministic, no timing."""
    gate = threading.Event()
    training_thread = threading.current_thread()

    class OpeningCondition(threading.Condition):
        def wait(self, timeout=None):
            if threading.current_thread() is training_thread:
                gate.set()
            return super().wait(timeout)

    monkeypatch.setattr(writer_module, "threading",
                        types.SimpleNamespace(Condition=OpeningCondition, Thread=threading.Thread))
    original = CheckpointStore.write

    def write(self, *args, **kwargs):
        gate.wait()
        gate.clear()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointStore, "write", write)


@pytest.mark.parametrize("max_in_flight", [1, 2], ids=["skipped-while-busy", "superseded-in-queue"])
def test_skip_policy_never_loses_or_moves_a_validation_record(monkeypatch, tmp_path, reference, max_in_flight):
    hold_writes_until_training_waits(monkeypatch)
    run_dir = str(tmp_path / "run")
    train_validated(run_dir, checkpoint=best_policy(writer="thread", when_behind="skip",
                                                    max_in_flight=max_in_flight), **VALIDATION)
    names = CheckpointStore(Storage(run_dir)).names()
    assert len(names) < len(CheckpointStore(Storage(reference)).names())  # the policy did skip some
    assert_every_record_on_its_validation(run_dir)
    assert_best_weights_equal(run_dir, reference)


def test_a_validation_at_an_epoch_end_gets_its_own_checkpoint(tmp_path):
    """at_epoch_end=False, checkpoints every 5 splits, validation at each epoch end (split 12):
    the epoch end is checkpointed for its record, which never lands on split 15's weights."""
    run_dir = str(tmp_path / "run")
    train_validated(run_dir, epochs=2, every_steps=None,
                    checkpoint=best_policy(every_n_splits=5, at_epoch_end=False))
    assert len(val_rows(run_dir)) == 2
    assert_every_record_on_its_validation(run_dir)


def test_best_checkpoints_reach_the_durable_tier(tmp_path, reference):
    """With a fast tier keeping 2 and the durable tier written only at the end, every
    validation's checkpoint still reaches the run dir, and the best one stays there."""
    run_dir = str(tmp_path / "run")
    policy = best_policy(keep_last=2, local_tier=str(tmp_path / "fast"), durable_every_n_splits=1000)
    train_validated(run_dir, checkpoint=policy, **VALIDATION)
    rows = val_rows(run_dir)
    best_row = min(rows, key=lambda row: row["metrics"]["val_loss"])
    report = inspect_run(run_dir)
    best = CheckpointStore(Storage(run_dir)).load(report["best"])
    assert best.manifest.monitor.value == best_row["metrics"]["val_loss"]
    cursor = best.progress.cursor
    assert (cursor.epoch, cursor.batch, cursor.split) == position(best_row)
    assert_best_weights_equal(run_dir, reference)


@pytest.fixture(scope="module")
def script_reference(tmp_path_factory):
    """The killed script's run, uninterrupted and without a fast tier; its best validation is
    the one at step 35, in the last epoch (not at its end)."""
    run_dir = str(tmp_path_factory.mktemp("script-reference"))
    train_validated(run_dir, epochs=3, every_steps=5, checkpoint=best_policy_of_the_script())
    best_row = min(val_rows(run_dir), key=lambda row: row["metrics"]["val_loss"])
    assert best_row["step"] == 35
    return run_dir, best_row


def kill_the_script(tmp_path, fault):
    run_dir, fast = str(tmp_path / "run"), str(tmp_path / "node" / "fast")
    process = forkserver.run([sys.executable, SCRIPT, run_dir, "--every-steps", "5", "--local-tier", fast],
                             env=environment(fault), capture_output=True, text=True, timeout=TIMEOUT)
    assert process.returncode == -signal.SIGKILL, process.stderr[-3000:]
    return run_dir, fast


def assert_resumed_run_keeps_the_reference_best(run_dir, fast, reference):
    train_validated(run_dir, epochs=3, every_steps=5, checkpoint=fast_tier_policy(fast))
    expected, actual = kept_best(reference), kept_best(run_dir)
    assert len(expected) == 2 and [entry[:2] for entry in actual] == [entry[:2] for entry in expected]
    for (*_, expected_module), (*_, actual_module) in zip(expected, actual):
        for key, tensor in expected_module.items():
            assert torch.equal(actual_module[key], tensor), key


@pytest.mark.slow
def test_a_kill_right_after_the_best_fast_commit_keeps_it(tmp_path, script_reference):
    """SIGKILL right after the fast commit of split 35, the run's best validation, whose copy to
    the run dir was just requested: the kept best checkpoints are those of an uninterrupted run
    without a fast tier (before, the fast tier's retention deleted it: keep_last=2)."""
    reference, best_row = script_reference
    run_dir, fast = kill_the_script(tmp_path, "split_end_after_checkpoint:35:sigkill")
    stranded = CheckpointStore(Storage(fast), create=False).latest()
    assert stranded.manifest.monitor.value == best_row["metrics"]["val_loss"]
    assert_resumed_run_keeps_the_reference_best(run_dir, fast, reference)


@pytest.mark.slow
def test_a_kill_inside_the_durable_copy_of_the_best_leaves_it_to_the_resumed_run(tmp_path, script_reference):
    """SIGKILL before the rename that would commit the best candidate's copy in the run dir:
    only the fast tier holds it; the resumed run copies it before deleting anything."""
    reference, best_row = script_reference
    # Commits reaching the rename before that copy: the fast ones up to split 35 (one per split
    # and one per epoch end) and the copies of the checkpoints of the validations before it.
    fast_commits = best_row["step"] + best_row["epoch"]
    copies = sum(1 for row in val_rows(reference) if row["step"] < best_row["step"])
    run_dir, fast = kill_the_script(tmp_path, f"checkpoint_before_rename:{fast_commits + copies + 1}:sigkill")
    stranded = CheckpointStore(Storage(fast), create=False).load(f"ckpt-{fast_commits:010d}")
    assert stranded.manifest.monitor.value == best_row["metrics"]["val_loss"]
    assert stranded.name not in CheckpointStore(Storage(run_dir)).committed_names()
    assert_resumed_run_keeps_the_reference_best(run_dir, fast, reference)
