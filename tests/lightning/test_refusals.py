"""Each feature engine.lightning does not run is refused before training with one line naming it."""

from __future__ import annotations

import datetime

import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from pytorch_lightning.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from torch import nn

import engine
import engine.lightning
from engine.lightning._refusals import UNSUPPORTED_EVALUATION_HOOKS, UNSUPPORTED_FIT_HOOKS
from lit_modules import FEATURES, LinearOnly, vectors
from torch.utils.data import DataLoader


class Plain(LinearOnly):
    """A module the adapter runs; the refusal cases each add one feature to it."""


def loader():
    return DataLoader(vectors(8, 1), batch_size=4)


def refused(error_type, match, make_trainer=None, model=None, run_dir=None, up_front=True, **fit):
    """fit raises ``error_type`` with a one-line message containing ``match``; nothing trained
    when it is refused ``up_front`` (what only a running step or a checkpoint reveals is not)."""
    model = model if model is not None else Plain()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error_type) as raised:
        trainer = make_trainer() if make_trainer else engine.lightning.Trainer(
            engine.TrainerConfig(max_epochs=1, run_dir=run_dir, progress_bar="off"))
        fit.setdefault("train_dataloaders", loader())
        trainer.fit(model, **fit)
    message = str(raised.value)
    assert match in message and "\n" not in message, message
    assert up_front == all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return message


def with_method(name, function):
    return type(f"Overrides_{name}", (Plain,), {name: function})()


@pytest.mark.parametrize("hook", sorted(UNSUPPORTED_FIT_HOOKS))
def test_an_unsupported_hook_is_refused_by_name(hook):
    refused(engine.ModuleContractError, f"Overrides_{hook}.{hook}: not supported by engine.lightning",
            model=with_method(hook, lambda self, *args, **kwargs: None))


@pytest.mark.parametrize("stage, hook", [(stage, hook) for stage, hooks in sorted(UNSUPPORTED_EVALUATION_HOOKS.items())
                                         for hook in sorted(hooks)])
def test_a_hook_validate_or_test_cannot_call_is_refused_there_by_name(stage, hook):
    model = with_method(hook, lambda self, *args, **kwargs: None)
    trainer = engine.lightning.Trainer(engine.TrainerConfig(progress_bar="off"))
    evaluate = trainer.validate if stage == "validation_step" else trainer.test
    with pytest.raises(engine.ModuleContractError, match=f"Overrides_{hook}.{hook}: not supported") as raised:
        evaluate(model, loader())
    assert "\n" not in str(raised.value)


def test_test_hooks_do_not_stop_validate():
    model = with_method("on_test_model_eval", lambda self: None)
    assert engine.lightning.Trainer(engine.TrainerConfig(progress_bar="off")).validate(model, loader()) == [{}]


class EverythingWrong(Plain):
    """Three refusals at once: fixing one must not merely reveal the next."""

    truncated_bptt_steps = 2

    def __init__(self, block=None):
        super().__init__()
        self.save_hyperparameters()

    def backward(self, loss):
        loss.backward()


def test_every_refusal_comes_before_training_in_one_message(tmp_path):
    message = refused(engine.ModuleContractError, "EverythingWrong.backward: not supported by engine.lightning",
                      model=EverythingWrong(block=nn.Linear(1, 1)), run_dir=str(tmp_path))
    assert all(part in message for part in ("EverythingWrong.backward", "hparams['block'] is a Linear",
                                             "truncated_bptt_steps is set but training_step has no 'hiddens'"))


@pytest.mark.parametrize("callback, match", [
    (LearningRateMonitor(), "the Lightning callback LearningRateMonitor is not supported"),
    (object(), "callbacks must be Lightning's ModelCheckpoint / EarlyStopping or engine.Callback objects, got object"),
    (ModelCheckpoint(filename="{epoch}"), "ModelCheckpoint(filename='{epoch}')"),
    (ModelCheckpoint(save_weights_only=True), "ModelCheckpoint(save_weights_only=True)"),
    (ModelCheckpoint(save_on_exception=True), "ModelCheckpoint(save_on_exception=True)"),
    (ModelCheckpoint(train_time_interval=datetime.timedelta(minutes=1)), "ModelCheckpoint(train_time_interval="),
    (ModelCheckpoint(save_on_train_epoch_end=True), "ModelCheckpoint(save_on_train_epoch_end=True)"),
    (ModelCheckpoint(every_n_epochs=2), "ModelCheckpoint(every_n_epochs=2)"),
    (ModelCheckpoint(dirpath="/somewhere/else"), "ModelCheckpoint(dirpath='/somewhere/else')"),
    (EarlyStopping(monitor="val_loss", stopping_threshold=0.1), "EarlyStopping(stopping_threshold=0.1)"),
    (EarlyStopping(monitor="val_loss", divergence_threshold=5.0), "EarlyStopping(divergence_threshold=5.0)"),
    (EarlyStopping(monitor="val_loss", strict=False), "EarlyStopping(strict=False)"),
])
def test_an_unsupported_callback_or_option_is_refused_by_name(callback, match, tmp_path):
    refused(engine.ConfigError, match, lambda: engine.lightning.Trainer(
        engine.TrainerConfig(run_dir=str(tmp_path), progress_bar="off"), callbacks=[callback]))


def test_two_model_checkpoints_are_refused(tmp_path):
    refused(engine.ConfigError, "more than one ModelCheckpoint", lambda: engine.lightning.Trainer(
        engine.TrainerConfig(run_dir=str(tmp_path)), callbacks=[ModelCheckpoint(), ModelCheckpoint()]))


def test_lightnings_trainer_arguments_and_ckpt_path_are_refused_naming_the_engines():
    refused(engine.ConfigError, "unknown argument 'accumulate_grad_batches'",
            lambda: engine.lightning.Trainer(accumulate_grad_batches=2))
    refused(engine.ConfigError, "unknown argument 'ckpt_path'", ckpt_path="last")


class TwoAutomaticOptimizers(Plain):
    def configure_optimizers(self):
        return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.Adam(self.parameters())]


class ManualPlain(Plain):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class SkipsBatches(Plain):
    def on_train_batch_start(self, batch, batch_idx):
        return -1


class ReturnsNone(Plain):
    def training_step(self, batch, batch_idx):
        return None


class NoHiddens(Plain):
    truncated_bptt_steps = 2


class NoDictWithHiddens(Plain):
    truncated_bptt_steps = 2

    def training_step(self, batch, batch_idx, hiddens):
        return self.layer(batch[0]).pow(2).mean()


class LogsInAHook(Plain):
    def on_train_epoch_start(self):
        self.log("lr", 0.1)


class UnknownReduction(Plain):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss, reduce_fx=torch.median)
        return loss


class LogsAMetricObject(Plain):
    def __init__(self):
        super().__init__()
        self.mean = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.mean.update(loss)
        self.log("mean_loss", self.mean)
        return loss


class ModuleHyperparameter(Plain):
    def __init__(self, block=None):
        super().__init__()
        self.save_hyperparameters()


class SavesAnObject(Plain):
    def on_save_checkpoint(self, checkpoint):
        checkpoint["when"] = datetime.date(2026, 1, 1)


def sequences_loader():
    return DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 4, FEATURES)), batch_size=2)


@pytest.mark.parametrize("model, error, match, fit", [
    (TwoAutomaticOptimizers(), engine.ModuleContractError, "returned 2 optimizers under automatic optimization", {}),
    (SkipsBatches(), engine.ModuleContractError, "on_train_batch_start returned -1", {}),
    (ReturnsNone(), engine.ModuleContractError, "training_step returned no loss (None", {}),
    (NoDictWithHiddens(), engine.ModuleContractError, "with truncated_bptt_steps return {'loss': loss, 'hiddens'",
     {"train_dataloaders": sequences_loader()}),
    (LogsInAHook(), engine.ModuleContractError, "self.log('lr') in a hook", {}),
    (UnknownReduction(), engine.ModuleContractError, "reduce_fx=<built-in method median", {}),
    (LogsAMetricObject(), engine.ModuleContractError, "self.log('mean_loss', <MeanMetric metric object>)", {}),
    (ModuleHyperparameter(block=nn.Linear(1, 1)), engine.ModuleContractError, "hparams['block'] is a Linear", {}),
    (object(), engine.ModuleContractError, "expects a LightningModule", {}),
], ids=lambda value: type(value).__name__ if isinstance(value, (pl.LightningModule, object)) else None)
def test_an_unsupported_module_feature_is_refused_by_name(model, error, match, fit, tmp_path):
    refused(error, match, model=model if isinstance(model, nn.Module) else _NotLightning(model),
            run_dir=str(tmp_path), **fit)


class _NotLightning(nn.Module):
    def __init__(self, _):
        super().__init__()
        self.layer = nn.Linear(1, 1)


def test_a_lightning_1x_tbptt_step_without_hiddens_is_refused():
    refused(engine.ModuleContractError, "truncated_bptt_steps is set but training_step has no 'hiddens' parameter",
            model=NoHiddens())


def test_an_on_save_checkpoint_entry_the_format_cannot_hold_is_refused(tmp_path):
    refused(engine.ModuleContractError, "on_save_checkpoint's checkpoint['when'] is a date", model=SavesAnObject(),
            run_dir=str(tmp_path), up_front=False)


def test_manual_optimization_under_16_mixed_is_refused():
    refused(engine.ConfigError, "precision='16-mixed' with manual optimization", lambda: engine.lightning.Trainer(
        engine.TrainerConfig(precision="16-mixed", progress_bar="off")), model=ManualPlain())


def test_a_datamodule_that_is_not_one_and_no_data_are_refused():
    refused(engine.ConfigError, "datamodule must be a LightningDataModule, got list", datamodule=[1],
            train_dataloaders=None)
    refused(engine.ConfigError, "fit: no training data", train_dataloaders=None)


class ConfiguresAnUnsupportedCallback(Plain):
    def configure_callbacks(self):
        return [LearningRateMonitor()]


def test_an_unsupported_callback_from_configure_callbacks_is_refused_up_front():
    refused(engine.ConfigError, "the Lightning callback LearningRateMonitor is not supported",
            model=ConfiguresAnUnsupportedCallback())


class LightningNamedCallback(engine.Callback):
    """An engine.Callback written with Lightning's hook names, which the engine never calls."""

    def on_train_batch_end(self, view):
        pass

    def on_epoch_ends(self, view):
        pass

    def on_split_end(self, view):  # an engine hook: fine
        pass


@pytest.mark.parametrize("make_trainer", [engine.Trainer, engine.lightning.Trainer], ids=["engine", "lightning"])
def test_an_engine_callback_method_named_like_a_hook_it_is_not_is_refused_with_the_hook_meant(make_trainer):
    with pytest.raises(engine.ConfigError) as raised:
        make_trainer(engine.TrainerConfig(progress_bar="off"), callbacks=[LightningNamedCallback()])
    message = str(raised.value)
    assert "LightningNamedCallback.on_train_batch_end is not an engine.Callback hook and would never be called; did " \
           "you mean on_split_end?" in message and "on_epoch_ends is not an engine.Callback hook" in message
    assert "did you mean on_epoch_end?" in message and "\n" not in message and "on_split_end is not" not in message
