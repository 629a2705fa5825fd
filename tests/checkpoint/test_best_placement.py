"""A best-checkpoint record lands on the weights it was computed on, and is never lost:

* with ``asynchronous=True, when_behind="skip"`` a snapshot that records a validation's value is
  neither skipped nor superseded (it waits for a buffer), and no later checkpoint inherits it;
* a validation at an epoch end without ``at_epoch_end`` checkpoints gets a checkpoint of its own;
* with a fast local tier, a candidate best checkpoint always reaches the durable tier (where
  ``inspect`` and ``load_weights(checkpoint="best")`` find it) and its retention keeps it.
"""

from __future__ import annotations

import json
import os
import threading
import types

import pytest
import torch

import engine
from engine.checkpoint import writer as writer_module
from engine.checkpoint.storage import Storage
from engine.checkpoint.store import CheckpointStore
from engine.cli.commands import inspect_run
from validation_scenarios import build_validated, train_validated

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
    train_validated(run_dir, checkpoint=best_policy(asynchronous=True, when_behind="skip",
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
