"""The LightningModule surface through engine.lightning.Trainer: hooks in Lightning's order with
Lightning's current_epoch / global_step, self.log's names and batch-size-weighted means,
self.trainer, save_hyperparameters and on_save/on_load_checkpoint, a LightningDataModule,
validate() and test()."""

from __future__ import annotations

import ast
import json
import pathlib
import sys

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import engine
import engine.lightning
from engine.cli.commands import inspect_run, run_inspect
from lit_modules import FEATURES, LinearOnly, vectors

HOOKS = ("on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start", "on_train_batch_end",
         "on_validation_start", "on_validation_epoch_start", "on_validation_batch_start", "on_validation_batch_end",
         "on_validation_epoch_end", "on_validation_end", "on_train_epoch_end", "on_train_end", "on_fit_end",
         "on_test_start", "on_test_epoch_start", "on_test_batch_start", "on_test_batch_end", "on_test_epoch_end",
         "on_test_end")


def recording(hook):
    def record(self, *args):
        self.calls.append((hook, self.current_epoch, self.global_step))
    return record


class HookRecorder(pl.LightningModule):
    """Records each hook with the epoch and step Lightning shows it, and what each step logged."""

    locals().update({hook: recording(hook) for hook in HOOKS})

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(FEATURES, 1)
        self.calls, self.logged, self.validated = [], [], []

    def training_step(self, batch, batch_idx):
        x, _ = batch
        loss = self.layer(x).pow(2).mean()
        self.calls.append(("training_step", self.current_epoch, self.global_step, batch_idx))
        self.log("loss_both", loss, on_step=True, on_epoch=True, batch_size=len(x) + batch_idx)
        self.log("loss_max", loss, on_epoch=True, on_step=False, reduce_fx="max")
        self.logged.append((float(loss), len(x) + batch_idx))
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.calls.append(("on_before_optimizer_step", self.current_epoch, self.global_step))

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        loss = self.layer(x).pow(2).mean()
        self.log("val_loss", loss)
        self.validated.append((float(loss), len(x)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def data():
    # 20 samples in batches of 8: 8, 8, 4 (a smaller last batch, so means must be weighted)
    return DataLoader(vectors(20, 1), batch_size=8), DataLoader(vectors(20, 2), batch_size=8)


def adapter_fit(model, run_dir, epochs=2, callbacks=(), **fit):
    config = engine.TrainerConfig(max_epochs=epochs, run_dir=str(run_dir), progress_bar="off")
    return engine.lightning.Trainer(config, callbacks=list(callbacks)).fit(model, **fit)


def rows(run_dir, stage):
    lines = pathlib.Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if json.loads(line).get("stage") == stage]


def test_hooks_come_in_lightnings_order_with_its_epoch_and_step(tmp_path):
    torch.manual_seed(0)
    expected = HookRecorder()
    train, val = data()
    pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, num_sanity_val_steps=0).fit(expected, train, val)
    torch.manual_seed(0)
    model = HookRecorder()
    adapter_fit(model, tmp_path / "run", train_dataloaders=train, val_dataloaders=val)
    assert model.calls == expected.calls
    assert model.calls[-1] == ("on_fit_end", 2, 6)


def test_log_writes_lightnings_names_and_batch_size_weighted_means(tmp_path):
    torch.manual_seed(0)
    model = HookRecorder()
    train, val = data()
    adapter_fit(model, tmp_path, epochs=1, train_dataloaders=train, val_dataloaders=val)
    steps, (epoch,), (validation,) = rows(tmp_path, "train"), rows(tmp_path, "train_epoch"), rows(tmp_path, "val")
    assert [row["metrics"] for row in steps] == [{"loss_both_step": value} for value, _ in model.logged]
    weighted = sum(value * size for value, size in model.logged) / sum(size for _, size in model.logged)
    assert epoch["metrics"] == {"loss_both_epoch": weighted, "loss_both": weighted,
                                "loss_max": max(value for value, _ in model.logged)}
    inferred = sum(value * size for value, size in model.validated) / sum(size for _, size in model.validated)
    assert validation["metrics"] == {"val_loss": inferred}
    assert [size for _, size in model.validated] == [8, 8, 4]


class LogsOnStepInValidation(HookRecorder):
    def validation_step(self, batch, batch_idx):
        x, _ = batch
        loss = self.layer(x).pow(2).mean()
        self.log("val_loss", loss, on_step=True)
        self.log("val_worst", loss, on_step=True, on_epoch=False, reduce_fx="max")
        self.validated.append((float(loss), len(x)))


def test_on_step_in_validation_step_is_one_value_per_pass(tmp_path):
    torch.manual_seed(0)
    model = LogsOnStepInValidation()
    train, val = data()
    adapter_fit(model, tmp_path, epochs=2, train_dataloaders=train, val_dataloaders=val)
    passes = [model.validated[:3], model.validated[3:]]
    means = [sum(value * size for value, size in batches) / sum(size for _, size in batches) for batches in passes]
    assert [row["metrics"] for row in rows(tmp_path, "val")] == [
        {"val_loss": mean, "val_loss_epoch": mean, "val_worst": max(value for value, _ in batches)}
        for mean, batches in zip(means, passes)]


class StopsItself(HookRecorder):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        seen = self.trainer
        self.views = getattr(self, "views", []) + [(seen.max_epochs, seen.is_global_zero, seen.world_size,
                                                    sorted(seen.callback_metrics))]
        if self.global_step == 4:
            self.trainer.should_stop = True
        return loss


def test_self_trainer_shows_the_run_and_should_stop_stops_it(tmp_path):
    model = StopsItself()
    train, _ = data()
    result = adapter_fit(model, tmp_path, epochs=5, train_dataloaders=train)
    assert result.stop_reason == "the LightningModule set trainer.should_stop" and result.optimizer_steps == 5
    assert model.views[0] == (5, True, 1, [])
    assert model.views[1] == (5, True, 1, ["loss_both_step"])
    assert "loss_both" in model.views[-1][3]  # after the first epoch: its aggregate


class Remembers(pl.LightningModule):
    def __init__(self, width: int = 3, name: str = "remembers"):
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(FEATURES, width)
        self.loaded = None
        self.extra = [1, 2]

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["extra"] = self.extra

    def on_load_checkpoint(self, checkpoint):
        self.loaded = checkpoint


def test_hyperparameters_and_on_save_checkpoint_are_saved_shown_and_given_back(tmp_path, capsys):
    train, _ = data()
    adapter_fit(Remembers(width=2), tmp_path, epochs=1, train_dataloaders=train)
    assert inspect_run(str(tmp_path))["hyperparameters"] == {"width": 2, "name": "remembers"}
    run_inspect(str(tmp_path), as_json=False)
    assert 'hyperparameters: {"name": "remembers", "width": 2}' in capsys.readouterr().out
    resumed = Remembers(width=2)
    adapter_fit(resumed, tmp_path, epochs=2, train_dataloaders=train)
    assert resumed.loaded == {"extra": [1, 2], "hyper_parameters": {"width": 2, "name": "remembers"}}


class CountingData(pl.LightningDataModule):
    def __init__(self):
        super().__init__()
        self.calls, self.served = [], 0

    def prepare_data(self):
        self.calls.append("prepare_data")

    def setup(self, stage):
        self.calls.append(f"setup {stage}")

    def teardown(self, stage):
        self.calls.append(f"teardown {stage}")

    def train_dataloader(self):
        self.served += 1
        return data()[0]

    def val_dataloader(self):
        return data()[1]

    def state_dict(self):
        return {"served": self.served}

    def load_state_dict(self, state):
        self.calls.append(f"load_state_dict {state['served']}")


def test_a_datamodule_is_prepared_set_up_and_its_state_checkpointed(tmp_path):
    module = CountingData()
    torch.manual_seed(0)
    adapter_fit(HookRecorder(), tmp_path, epochs=1, datamodule=module)
    assert module.calls == ["prepare_data", "setup fit", "teardown fit"] and rows(tmp_path, "val")
    again = CountingData()
    adapter_fit(HookRecorder(), tmp_path, epochs=2, datamodule=again)
    assert again.calls == ["prepare_data", "setup fit", "load_state_dict 1", "teardown fit"]


class NoValidationStep(LinearOnly):
    """One linear layer, no validation_step."""


def test_validation_data_without_validation_step_is_not_used_with_a_warning_as_in_lightning(tmp_path):
    train, val = data()
    with pytest.warns(UserWarning, match="NoValidationStep has no validation_step: the validation data is not used"):
        adapter_fit(NoValidationStep(), tmp_path, epochs=1, train_dataloaders=train, val_dataloaders=val)
    assert rows(tmp_path, "val") == []


class WithTestStep(HookRecorder):
    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)


def test_validate_and_test_return_batch_size_weighted_means():
    torch.manual_seed(0)
    model = WithTestStep()
    _, val = data()
    trainer = engine.lightning.Trainer(engine.TrainerConfig(progress_bar="off"))
    validated = trainer.validate(model, val)
    inferred = sum(value * size for value, size in model.validated) / sum(size for _, size in model.validated)
    assert validated == [{"val_loss": inferred}] and len(model.validated) == 3
    assert trainer.test(model, val) == validated and model.training


def test_validate_and_test_call_lightnings_hooks_in_its_order_after_fit(tmp_path):
    train, val = data()
    lightning = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                           enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    adapter = engine.lightning.Trainer(engine.TrainerConfig(max_epochs=1, run_dir=str(tmp_path), progress_bar="off"))
    calls = []
    for trainer in (lightning, adapter):
        torch.manual_seed(0)
        model = WithTestStep()
        trainer.fit(model, train)
        model.calls.clear()
        trainer.validate(model, val)
        trainer.test(model, val)
        calls.append(model.calls)
    assert calls[0] == calls[1]
    assert calls[1][0] == ("on_validation_start", 1, 3) and calls[1][-1] == ("on_test_end", 1, 3)


def test_importing_engine_never_imports_lightning():
    """No module outside engine/lightning imports Lightning or engine.lightning (read from the source)."""
    engine_dir = pathlib.Path(engine.__file__).parent
    importers = []
    for path in engine_dir.rglob("*.py"):
        if engine_dir / "lightning" in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            importers += [(path.name, name) for name in names
                          if name.split(".")[0] in ("pytorch_lightning", "lightning") or name.startswith("engine.lightning")]
    assert importers == []


def autoencoder_on(base):
    """The same small autoencoder on either package's LightningModule."""
    class AutoEncoder(base):
        def __init__(self):
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(FEATURES, 4), nn.ReLU(), nn.Linear(4, FEATURES))

        def training_step(self, batch, batch_idx):
            loss = F.mse_loss(self.net(batch[0]), batch[0])
            self.log("train_loss", loss, on_epoch=True)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", F.mse_loss(self.net(batch[0]), batch[0]))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)
    return AutoEncoder


def test_a_lightning_pytorch_module_and_callbacks_run_as_pytorch_lightnings_do(tmp_path):
    import lightning.pytorch as L

    finished = []
    for package, run_dir in ((pl, tmp_path / "pl"), (L, tmp_path / "L")):
        torch.manual_seed(0)
        model = autoencoder_on(package.LightningModule)()
        train, val = data()
        callbacks = [package.callbacks.ModelCheckpoint(monitor="val_loss", save_top_k=2),
                     package.callbacks.EarlyStopping(monitor="val_loss", patience=5)]
        adapter_fit(model, run_dir, epochs=3, callbacks=callbacks, train_dataloaders=train, val_dataloaders=val)
        finished.append((model.state_dict(), pathlib.Path(run_dir, "metrics.jsonl").read_bytes(),
                         inspect_run(str(run_dir))["best"]))
    (pl_state, pl_metrics, pl_best), (state, metrics, best) = finished
    assert all(torch.equal(pl_state[key], state[key]) for key in state) and metrics == pl_metrics
    assert best == pl_best is not None
    with pytest.raises(engine.ConfigError, match="the Lightning callback LearningRateMonitor is not supported"):
        engine.lightning.Trainer(callbacks=[L.callbacks.LearningRateMonitor()])


def test_moving_the_run_to_a_device_moves_the_module_and_its_self_device():
    from engine.lightning._bridge import LightningBridge

    model = HookRecorder()
    LightningBridge(model).to(torch.device("meta"))  # what the engine does with TrainerConfig.device
    assert model.device == torch.device("meta") and model.layer.weight.device == torch.device("meta")


def test_without_lightning_installed_the_import_says_what_to_install(monkeypatch):
    import importlib

    for name in ("pytorch_lightning", "lightning", "lightning.pytorch"):
        monkeypatch.setitem(sys.modules, name, None)  # what an uninstalled package looks like to import
    monkeypatch.delitem(sys.modules, "engine.lightning._packages")
    with pytest.raises(ImportError, match=r"engine.lightning needs PyTorch Lightning: pip install 'splitloop\[lightning\]'"):
        importlib.import_module("engine.lightning._packages")


class StopsEarly(HookRecorder):
    def configure_callbacks(self):
        return pl.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)


def test_configure_callbacks_callbacks_replace_the_trainers_of_their_class_as_in_lightning(tmp_path):
    train, val = data()
    patient = pl.callbacks.EarlyStopping(monitor="val_loss", patience=50)
    result = adapter_fit(StopsEarly(), tmp_path, epochs=4, callbacks=[patient], train_dataloaders=train,
                         val_dataloaders=val)
    assert "early stopping" in result.stop_reason and len(rows(tmp_path, "val")) == 2  # the module's, not patient


class ClaimsMoreBatches(list):
    def __len__(self):
        return 99


def test_the_engines_warnings_point_at_the_users_line_through_the_adapter(tmp_path):
    batches = ClaimsMoreBatches(data()[0])
    with pytest.warns(UserWarning, match=r"len\(train_data\) is 99 but epoch 0 yielded 3 batches") as caught:
        adapter_fit(LinearOnly(), tmp_path, epochs=1, train_dataloaders=batches)
    assert {warning.filename for warning in caught if "len(train_data)" in str(warning.message)} == {__file__}
