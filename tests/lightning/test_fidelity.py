"""Without shuffling or dropout, a LightningModule trained through engine.lightning.Trainer sees
the same losses, bit for bit, as under pytorch_lightning.Trainer on the CPU with the same seed,
and ends with the same parameters; a Lightning 1.x TBPTT module (which Lightning 2.x cannot run)
trains as the same model written as an engine.Module."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import pytorch_lightning as pl
import torch

import engine
import engine.lightning
from lit_modules import FEATURES, LitTBPTT, build, loaders

EPOCHS = {"autoencoder": 2, "gan": 2, "gru_lm": 3, "clipped": 2}  # the plateau first lowers the rate after epoch 1


class RecordLosses(pl.Callback):
    """What each training batch logged, and the learning rate after it, as Lightning's trainer
    saw them after the batch."""

    def __init__(self, names):
        self.names, self.rows, self.rates = names, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append([float(trainer.callback_metrics[name]) for name in self.names])
        self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])


def validates(name):
    """The GRU LM validates, for ReduceLROnPlateau's monitor; the others train only."""
    return name == "gru_lm"


def lightning_run(name, names):
    model = build(name)
    train_loader, val_loader = loaders(name, shuffle=False)
    recorder = RecordLosses(names)
    trainer = pl.Trainer(max_epochs=EPOCHS[name], accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[recorder])
    trainer.fit(model, train_loader, val_loader if validates(name) else None)
    return model, recorder.rows, recorder.rates


def adapter_run(name, names, run_dir):
    model = build(name)
    train_loader, val_loader = loaders(name, shuffle=False)
    config = engine.TrainerConfig(max_epochs=EPOCHS[name], run_dir=str(run_dir), progress_bar="off")
    engine.lightning.Trainer(config).fit(model, train_loader, val_loader if validates(name) else None)
    lines = pathlib.Path(run_dir, "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return model, [[row["metrics"][n] for n in names] for row in rows if row.get("stage") == "train"]


@pytest.mark.parametrize("name, names", [("autoencoder", ["train_loss_step"]), ("gan", ["g_loss", "d_loss"]),
                                         ("gru_lm", ["train_loss"]), ("clipped", ["train_loss"])])
def test_losses_and_parameters_equal_pytorch_lightning_trainer_bit_for_bit(name, names, tmp_path):
    expected_model, expected, rates = lightning_run(name, names)
    if name == "gru_lm":  # ReduceLROnPlateau(monitor="val_loss") lowered the rate at each epoch end
        assert rates == [rates[0]] * 10 + [rates[0] / 2] * 5
    if name == "clipped":  # stepped by the module (manual optimization) after each step
        assert rates[:4] == [1.0, 0.5, 0.5, 0.25]  # StepLR(step_size=2, gamma=0.5)
    model, actual = adapter_run(name, names, tmp_path / "run")
    assert len(expected) == len(actual) == EPOCHS[name] * 5
    assert torch.equal(torch.tensor(expected, dtype=torch.float64), torch.tensor(actual, dtype=torch.float64))
    expected_state, state = expected_model.state_dict(), model.state_dict()
    assert list(expected_state) == list(state)
    assert all(torch.equal(expected_state[key], state[key]) for key in state)


class NativeTBPTT(engine.Module):
    """lit_modules.LitTBPTT written for the engine directly (the same layers, built in the same order)."""

    tbptt_split_length = 4

    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(FEATURES, 8, batch_first=True)
        self.head = torch.nn.Linear(8, FEATURES)

    def training_step(self, batch, hidden):
        x, y = batch
        out, hidden = self.rnn(x, hidden)
        return torch.nn.functional.mse_loss(self.head(out), y), hidden

    def configure_optimizers(self):
        return LitTBPTT.configure_optimizers(self)


def test_a_lightning_1x_tbptt_module_trains_as_the_engines_own_tbptt_module_bit_for_bit(tmp_path):
    lit = build("tbptt")
    pl.seed_everything(7, verbose=False)
    native = NativeTBPTT()
    train_loader, _ = loaders("tbptt", shuffle=False)
    config = engine.TrainerConfig(max_epochs=2, progress_bar="off")
    engine.lightning.Trainer(dataclasses.replace(config, run_dir=str(tmp_path / "lit"))).fit(lit, train_loader)
    engine.Trainer(dataclasses.replace(config, run_dir=str(tmp_path / "native"))).fit(native, train_loader)
    losses = [[row["loss"] for row in map(json.loads, pathlib.Path(tmp_path, run, "metrics.jsonl").read_text().splitlines())
               if row.get("stage") == "train"] for run in ("lit", "native")]
    assert len(losses[0]) == 2 * 5 * 4
    assert torch.equal(torch.tensor(losses[0], dtype=torch.float64), torch.tensor(losses[1], dtype=torch.float64))
    assert all(torch.equal(lit.state_dict()[key], value) for key, value in native.state_dict().items())
