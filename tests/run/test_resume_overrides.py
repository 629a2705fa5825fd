"""A resumed checkpoint's optimizer and scheduler settings replace those configure_optimizers
built: the run names each replaced setting on its start line and in a warning, and a callback's
on_fit_start can set them after the restore (docs/guarantees.md, Changing hyper-parameters on
resume)."""

from __future__ import annotations

import warnings

import pytest
import torch

import engine

OVERRIDES = "overrides what configure_optimizers built"


class Regression(engine.Module):
    def __init__(self, lr: float, scheduled: bool = False, momentum: float = 0.9) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(2, 1)
        self.lr, self.scheduled, self.momentum = lr, scheduled, momentum

    def training_step(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        if not self.scheduled:
            return optimizer
        return {"optimizers": [optimizer], "schedulers": [torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)]}


class SetLearningRate(engine.Callback):
    """The documented way to change the learning rate on resume (docs/guarantees.md)."""

    def __init__(self, module: engine.Module, lr: float) -> None:
        self.module, self.lr = module, lr

    def on_fit_start(self, view: engine.RunView) -> None:
        for group in self.module.optimizers().param_groups:
            group["lr"] = self.lr


def batches():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 2, generator=generator), torch.randn(4, 1, generator=generator)) for _ in range(3)]


def fit(run_dir, module, epochs, callbacks=()):
    config = engine.TrainerConfig(max_epochs=epochs, run_dir=str(run_dir), progress_bar="log")
    return engine.Trainer(config, callbacks=list(callbacks)).fit(module, batches())


def fit_without_warnings(run_dir, module, epochs, callbacks=()):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(run_dir, module, epochs, callbacks)
    assert not [str(w.message) for w in caught if OVERRIDES in str(w.message)]


def test_a_changed_learning_rate_is_named_on_the_start_line_and_in_a_warning(tmp_path, capsys):
    fit(tmp_path, Regression(lr=3e-3), epochs=1)
    capsys.readouterr()
    changed = Regression(lr=1e-3, momentum=0.5)
    expected = "optimizer 0 group 0 lr: checkpoint 0.003, configure_optimizers 0.001"
    with pytest.warns(UserWarning, match=OVERRIDES) as caught:
        fit(tmp_path, changed, epochs=2)
    message = str(caught[0].message)
    assert expected in message and "optimizer 0 group 0 momentum: checkpoint 0.9, configure_optimizers 0.5" in message
    start_line = [line for line in capsys.readouterr().err.splitlines() if "resuming from" in line][0]
    assert expected in start_line and "Changing hyper-parameters on resume" in start_line
    assert changed.optimizers().param_groups[0]["lr"] == 3e-3  # what the checkpoint held, as warned


def test_with_a_scheduler_its_initial_lr_is_compared_not_the_lr_it_moved(tmp_path):
    fit(tmp_path, Regression(lr=3e-3, scheduled=True), epochs=1)
    fit_without_warnings(tmp_path, Regression(lr=3e-3, scheduled=True), epochs=2)  # lr moved by StepLR: no override
    with pytest.warns(UserWarning, match=OVERRIDES) as caught:
        fit(tmp_path, Regression(lr=1e-3, scheduled=True), epochs=3)
    message = str(caught[0].message)
    assert "optimizer 0 group 0 initial_lr: checkpoint 0.003, configure_optimizers 0.001" in message
    assert "scheduler 0 base_lrs: checkpoint [0.003], configure_optimizers [0.001]" in message
    assert "group 0 lr:" not in message and "last_epoch" not in message


def test_a_callback_sets_the_learning_rate_on_resume_and_the_checkpoints_keep_it(tmp_path):
    fit(tmp_path, Regression(lr=3e-3), epochs=1)
    changed = Regression(lr=1e-3)
    fit_without_warnings(tmp_path, changed, epochs=2, callbacks=[SetLearningRate(changed, 1e-3)])
    assert changed.optimizers().param_groups[0]["lr"] == 1e-3
    # The next resume, without the callback, finds 1e-3 in the checkpoint: nothing to override.
    again = Regression(lr=1e-3)
    fit_without_warnings(tmp_path, again, epochs=3)
    assert again.optimizers().param_groups[0]["lr"] == 1e-3


def test_an_unchanged_resume_reports_nothing_and_stays_exact(tmp_path):
    straight, staged = tmp_path / "straight", tmp_path / "staged"
    reference = Regression(lr=3e-3, scheduled=True)
    fit(straight, reference, epochs=3)
    fit(staged, Regression(lr=3e-3, scheduled=True), epochs=1)
    resumed = Regression(lr=3e-3, scheduled=True)
    fit_without_warnings(staged, resumed, epochs=3)
    for key, value in reference.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key])
