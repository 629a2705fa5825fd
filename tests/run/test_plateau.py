"""ReduceLROnPlateau with a monitor: stepped by the engine with the metric's value at the points a
hand-written loop steps it, its state checkpointed, and a run killed anywhere resumes with the
same learning rates and parameters, bit for bit; a monitor naming no metric is a one-line error
where the scheduler is first due."""

from __future__ import annotations

import pathlib
import random
import signal
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import engine
from kill_helpers import kill_at_random_instant, run_scenario, run_until_done
from plateau_scenario import train_plateau
from resume_helpers import assert_resumes_are_exact, assert_same_run, read_metrics
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore

SCRIPT = str(pathlib.Path(__file__).parent.parent / "plateau_scenario.py")
BATCHES, EPOCHS, STEP_FREQUENCY = 4, 4, 3


def regression_data(seed: int, samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 3, generator=generator)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3 * torch.randn(samples, 1, generator=generator))


class Regression(engine.Module):
    """A linear model; two plateaus on its SGD: per batch on the training loss, per epoch on val_loss."""

    def __init__(self, monitors: tuple[str, str] = ("train_loss", "val_loss"), form: str = "schedule") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(3, 1)
        self.monitors, self.form = monitors, form

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.linear(x), y)

    def training_step(self, batch: Any) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> Any:
        optimizer, by_batch, by_epoch = make_schedulers(self)
        if self.form == "lightning":
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": by_epoch, "monitor": self.monitors[1],
                                                             "interval": "epoch", "frequency": 1}}
        return {"optimizers": optimizer, "schedulers": [
            engine.LRSchedule(by_batch, "step", monitor=self.monitors[0], frequency=STEP_FREQUENCY),
            engine.LRSchedule(by_epoch, monitor=self.monitors[1])]}


def make_schedulers(model: Regression) -> tuple[torch.optim.SGD, Any, Any]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    return optimizer, plateau(optimizer, factor=0.5, patience=0, threshold=0.2), plateau(optimizer, factor=0.3,
                                                                                        patience=0, threshold=0.5)


def loaders() -> tuple[DataLoader, DataLoader]:
    return DataLoader(regression_data(1, 4 * BATCHES), batch_size=4), DataLoader(regression_data(2, 8), batch_size=4)


class LearningRates(engine.Callback):
    def __init__(self, optimizer_of: Any) -> None:
        self.optimizer_of, self.rates = optimizer_of, []

    def on_split_end(self, view: engine.RunView) -> None:
        self.rates.append(self.optimizer_of().param_groups[0]["lr"])


def train_with_engine(form: str = "schedule") -> tuple[Regression, list[float]]:
    model = Regression(form=form)
    rates = LearningRates(model.optimizers)
    train, val = loaders()
    engine.Trainer(engine.TrainerConfig(max_epochs=EPOCHS, run_dir=None, checkpoint=None, progress_bar="off"),
                   callbacks=[rates]).fit(model, train, val)
    return model, rates.rates


def train_by_hand(with_batch_plateau: bool = True) -> tuple[Regression, list[float]]:
    """The same training written out: each plateau stepped with its metric where the docs say."""
    model = Regression()
    optimizer, by_batch, by_epoch = make_schedulers(model)
    train, val = loaders()
    rates, units = [], 0
    for _ in range(EPOCHS):
        for batch in train:
            optimizer.zero_grad()
            loss = model.loss(batch)
            loss.backward()
            optimizer.step()
            units += 1
            rates.append(optimizer.param_groups[0]["lr"])  # what on_split_end sees, before the plateau
            if with_batch_plateau and units % STEP_FREQUENCY == 0:
                by_batch.step(loss.item())
        with torch.no_grad():
            val_losses = [model.loss(batch).item() for batch in val]
        by_epoch.step(sum(val_losses) / len(val_losses))
    return model, rates


def test_the_engine_steps_each_plateau_with_its_metric_where_a_hand_written_loop_does():
    model, rates = train_with_engine()
    expected_model, expected_rates = train_by_hand()
    assert rates == expected_rates
    assert len(set(rates)) >= 4  # both plateaus really reduced the learning rate during the run
    for name, tensor in expected_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_lightnings_dict_with_a_monitored_epoch_plateau_trains_like_a_hand_written_loop():
    model, rates = train_with_engine(form="lightning")
    expected_model, expected_rates = train_by_hand(with_batch_plateau=False)
    assert rates == expected_rates and len(set(rates)) >= 2
    for name, tensor in expected_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


class SplitCount(engine.Callback):
    def __init__(self) -> None:
        self.splits = 0

    def on_split_end(self, view: engine.RunView) -> None:
        self.splits += 1


@pytest.mark.parametrize("monitors, splits_before_the_error, where", [
    (("train_loss", "val_los"), BATCHES, "at the end of epoch 0"),
    (("train_los", "val_loss"), STEP_FREQUENCY, f"after {STEP_FREQUENCY} units of step work"),
])
def test_a_monitor_that_names_no_metric_is_a_one_line_error_where_it_is_first_due(monitors, splits_before_the_error,
                                                                                   where):
    model, counter = Regression(monitors), SplitCount()
    train, val = loaders()
    trainer = engine.Trainer(engine.TrainerConfig(max_epochs=2, run_dir=None, checkpoint=None, progress_bar="off"),
                             callbacks=[counter])
    with pytest.raises(engine.ModuleContractError) as caught:
        trainer.fit(model, train, val)
    message = str(caught.value)
    missing = monitors[0] if monitors[0] != "train_loss" else monitors[1]
    assert "\n" not in message
    assert f"monitor={missing!r}" in message and where in message
    assert "'train_loss'" in message and "ReduceLROnPlateau" in message
    assert counter.splits == splits_before_the_error


# ---- resume: the scenario of tests/plateau_scenario.py (TBPTT, dropout, shuffling, validation) --------------

@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_plateau(run_dir, "lightning", checkpoint=engine.CheckpointConfig(keep_last=None))
    return run_dir


def learning_rates(run_dir: str) -> list[float]:
    import json

    return [row["metrics"]["lr"] for row in map(json.loads, read_metrics(run_dir).splitlines())
            if row["stage"] == "train"]


def test_the_scenario_reduces_the_learning_rate_mid_epoch_and_at_epoch_ends(reference):
    rates = learning_rates(reference)
    drops = [index for index in range(1, len(rates)) if rates[index] < rates[index - 1]]
    splits_per_epoch = len(rates) // 3
    assert any(index % splits_per_epoch != 0 for index in drops)  # a step-interval reduction
    assert any(index % splits_per_epoch == 0 for index in drops)  # an epoch-end reduction


def checkpoint_names(run_dir: str) -> list[str]:
    return CheckpointStore(Storage(run_dir)).names()


def test_resuming_at_the_checkpoints_around_each_plateau_step_gives_the_same_run(reference, tmp_path):
    # Units 2-4 hold the first step-interval step (unit 3); the last ones of epoch 0 its epoch-end step.
    names = checkpoint_names(reference)

    def resume(run_dir):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, result = train_plateau(run_dir, "lightning", checkpoint=engine.CheckpointConfig(keep_last=None))
        # The plateaus' progress (best, num_bad_epochs, _last_lr) is not reported as a changed setting.
        assert not [str(w.message) for w in caught if "overrides" in str(w.message)]
        return result

    assert_resumes_are_exact(reference, names[1:4] + names[11:14], resume, lambda name: str(tmp_path / name))


@pytest.mark.exhaustive
def test_resuming_at_every_checkpoint_gives_the_same_run(reference, tmp_path):
    assert_resumes_are_exact(reference, checkpoint_names(reference), lambda run_dir: train_plateau(
        run_dir, "lightning", checkpoint=engine.CheckpointConfig(keep_last=None))[1], lambda name: str(tmp_path / name))


@pytest.fixture(scope="module")
def reference_keep_two(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference_keep_two"))
    train_plateau(run_dir, "schedule")
    return run_dir


@pytest.mark.slow
def test_sigkill_right_after_a_plateau_step_before_its_checkpoint(reference_keep_two, tmp_path):
    # split_end and epoch_end are reached after the boundary's plateau step, before its checkpoint:
    # after unit 3 (a step-interval step), at the end of epoch 0, after unit 18 (resumed at 12), at
    # the end of epoch 1 (resumed at 17).
    run_dir = str(tmp_path / "run")
    kills = 0
    for faults in ["split_end:3:sigkill", "epoch_end:1:sigkill", "split_end:6:sigkill", "epoch_end:1:sigkill", None]:
        process = run_scenario("schedule", run_dir, faults, script=SCRIPT)
        assert process.returncode in (0, -signal.SIGKILL), process.stderr[-3000:]
        kills += process.returncode == -signal.SIGKILL
    assert kills == 4 and process.returncode == 0
    assert_same_run(reference_keep_two, run_dir)
    assert learning_rates(run_dir) == learning_rates(reference_keep_two)


@pytest.mark.slow
def test_sigkill_at_random_instants(reference_keep_two, tmp_path):
    rng = random.Random(21)
    run_dir = str(tmp_path / "run")
    kills = 0
    for _ in range(6):
        if not kill_at_random_instant("schedule", run_dir, rng, 1.0, "--sleep", "0.05", script=SCRIPT):
            break
        kills += 1
    assert run_until_done("schedule", run_dir, "", script=SCRIPT) == 0
    assert kills >= 3
    assert_same_run(reference_keep_two, run_dir)
    assert learning_rates(run_dir) == learning_rates(reference_keep_two)
