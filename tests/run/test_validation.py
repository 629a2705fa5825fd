"""Validation, logged metrics and early stopping: built into the loop tree with the same
guarantees as training (exact resume, rows exactly once, training unaffected)."""

from __future__ import annotations

import json

import pytest
import torch

import engine
import engine.testing
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from models import Regression
from resume_helpers import assert_resumes_are_exact, assert_same_run, read_metrics
from scenarios import LossRecorder
from validation_scenarios import build_validated, train_validated, val_loader

SPLITS_PER_EPOCH = 12  # 3 batches x 4 splits, one optimizer step each


def rows(run_dir, stage=None):
    parsed = [json.loads(line) for line in read_metrics(run_dir).decode().splitlines()]
    return [row for row in parsed if stage is None or row["stage"] == stage]


def parameters(model):
    return [p.detach().clone() for p in model.parameters()]


def test_training_with_validation_is_bit_identical_to_training_without():
    with_val_losses, without_val_losses = LossRecorder(), LossRecorder()
    with_val, with_result = train_validated(None, with_val=True, callbacks=(with_val_losses,))
    rng_after_with = torch.get_rng_state()
    without_val, _ = train_validated(None, with_val=False, callbacks=(without_val_losses,))
    rng_after_without = torch.get_rng_state()
    assert with_result.metrics["val_loss"] > 0  # validation did run (and drew random numbers)
    assert with_val_losses.losses == without_val_losses.losses
    for a, b in zip(parameters(with_val), parameters(without_val)):
        assert torch.equal(a, b)
    assert torch.equal(rng_after_with, rng_after_without)  # the global stream ends where it would have


def test_validation_runs_in_eval_mode_without_grad_and_restores_training_mode():
    seen = []

    class Probe(Regression):
        def validation_step(self, batch):
            seen.append((self.training, torch.is_grad_enabled()))
            return self.net(batch).mean()

    model = Probe()
    result = engine.Trainer(engine.TrainerConfig(max_epochs=2, progress_bar="off", checkpoint=None)).fit(
        model, [torch.ones(3, 2)] * 2, [torch.ones(3, 2)])
    assert seen == [(False, False), (False, False)]
    assert model.training is True
    assert "val_loss" in result.metrics


def test_rows_have_stages_and_epoch_aggregates_match_their_splits(tmp_path):
    run_dir = str(tmp_path / "run")
    _, result = train_validated(run_dir, epochs=2, every_steps=5)
    train, val, epochs = rows(run_dir, "train"), rows(run_dir, "val"), rows(run_dir, "train_epoch")
    assert len(train) == 2 * SPLITS_PER_EPOCH
    # mid-epoch at steps 5, 10, 15, 20 and one at each epoch end
    assert [row["step"] for row in val] == [5, 10, 12, 15, 20, 24]

    assert len(epochs) == 2
    for epoch, aggregate in enumerate(epochs):
        split_values = [row["metrics"]["train_loss_mean"] for row in train if row["epoch"] == epoch]
        maxima = [row["metrics"]["train_abs_hidden"] for row in train if row["epoch"] == epoch]
        assert aggregate["metrics"]["train_loss_mean"] == pytest.approx(sum(split_values) / len(split_values), rel=1e-12)
        assert aggregate["metrics"]["train_abs_hidden"] == max(maxima)
    assert set(val[0]["metrics"]) == {"val_loss", "val_noise", "val_max"}
    assert result.metrics["val_loss"] == val[-1]["metrics"]["val_loss"]
    assert result.metrics["train_loss_mean"] == epochs[-1]["metrics"]["train_loss_mean"]


def test_an_epoch_end_validation_is_not_repeated_when_the_weights_did_not_change(tmp_path):
    run_dir = str(tmp_path / "run")
    train_validated(run_dir, epochs=2, every_steps=4)  # step 12 ends epoch 0 and is a multiple of 4
    assert [row["step"] for row in rows(run_dir, "val")] == [4, 8, 12, 16, 20, 24]


def test_validation_results_do_not_depend_on_the_process(tmp_path):
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    train_validated(first, epochs=1)
    train_validated(second, epochs=1)
    assert rows(first, "val") == rows(second, "val")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_validated(run_dir, epochs=2, every_steps=5)
    return run_dir


def test_resume_from_every_checkpoint_is_exact_with_validation_and_aggregates(reference, tmp_path):
    names = CheckpointStore(Storage(reference)).names()
    assert len(names) > 20
    assert_resumes_are_exact(reference, names[::3] + [names[-1]],
                             lambda run_dir: train_validated(run_dir, epochs=2, every_steps=5)[1],
                             lambda name: str(tmp_path / name))


def test_a_failure_inside_validation_resumes_and_logs_its_rows_once(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    engine.testing.inject([engine.testing.Fault("validation_batch_end", 3, "raise")])
    try:
        with pytest.raises(engine.InjectedFault):
            train_validated(run_dir, epochs=2, every_steps=5)
    finally:
        engine.testing.clear()
    _, result = train_validated(run_dir, epochs=2, every_steps=5)
    assert result.resumed_from is not None
    assert_same_run(reference, run_dir)


def test_early_stopping_stops_at_the_same_step_with_and_without_interruptions(tmp_path):
    def stopper():
        return engine.EarlyStopping("val_noise", mode="max", patience=2)

    _, reference = train_validated(str(tmp_path / "reference"), epochs=4, every_steps=3, callbacks=(stopper(),))
    assert reference.stop_reason and reference.stop_reason.startswith("early stopping")
    run_dir = str(tmp_path / "interrupted")
    for hit in (2, 3, 5):
        engine.testing.inject([engine.testing.Fault("split_end", hit, "raise")])
        try:
            with pytest.raises(engine.InjectedFault):
                train_validated(run_dir, epochs=4, every_steps=3, callbacks=(stopper(),))
        finally:
            engine.testing.clear()
    _, resumed = train_validated(run_dir, epochs=4, every_steps=3, callbacks=(stopper(),))
    assert resumed.optimizer_steps == reference.optimizer_steps
    assert resumed.stop_reason == reference.stop_reason
    assert_same_run(str(tmp_path / "reference"), run_dir)


@pytest.mark.parametrize("kwargs, error", [
    (dict(monitor=""), "monitor"), (dict(mode="up"), "mode"), (dict(patience=0), "patience"),
    (dict(min_delta=-1), "min_delta"), (dict(check_on="step"), "check_on"),
])
def test_early_stopping_rejects_bad_settings(kwargs, error):
    with pytest.raises(engine.ConfigError, match=error):
        engine.EarlyStopping(**kwargs)


def test_early_stopping_names_the_metrics_when_the_monitor_is_missing():
    with pytest.raises(engine.ConfigError, match="val_loss"):
        train_validated(None, epochs=1, callbacks=(engine.EarlyStopping("nope"),))


def test_a_module_without_validation_step_is_refused():
    model, loader = build_validated()
    model.validation_step = None
    with pytest.raises(engine.ModuleContractError, match="validation_step"):
        engine.Trainer(engine.TrainerConfig(progress_bar="off", checkpoint=None)).fit(model, loader, val_loader())


def test_one_shot_or_string_validation_data_is_refused():
    model, loader = build_validated()
    trainer = engine.Trainer(engine.TrainerConfig(progress_bar="off", checkpoint=None))
    with pytest.raises(engine.DataError, match="one-shot"):
        trainer.fit(model, loader, (batch for batch in val_loader()))
    with pytest.raises(engine.ConfigError, match="resume="):
        trainer.fit(model, loader, "auto")


def test_log_outside_fit_and_bad_values_are_refused():
    model, _ = build_validated()
    with pytest.raises(engine.ModuleContractError, match="only while"):
        model.log("x", 1.0)


def test_adding_validation_to_a_run_is_refused_clearly(tmp_path):
    run_dir = str(tmp_path / "run")
    train_validated(run_dir, epochs=1, with_val=False)
    with pytest.raises(engine.CheckpointIncompatible, match="validation"):
        train_validated(run_dir, epochs=2, with_val=True)
