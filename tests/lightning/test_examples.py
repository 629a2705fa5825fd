"""Lightning's own example modules run unchanged through engine.lightning.Trainer: its demos
(``BoringModel``, with its own data, validation_step and scheduler; ``LightningTransformer``,
with dropout) and modules written in the shape of Lightning's basics examples (a predict_step,
``self.log(..., on_step=True)`` in validation_step, test and validation-batch hooks,
configure_callbacks) train as under ``lightning.pytorch.Trainer``, bit for bit; after fit the
module and the trainer show the run's step and epoch, as Lightning's do."""

from __future__ import annotations

import json
import pathlib
import warnings

import lightning.pytorch as L
import pytest
import torch

import engine
import engine.lightning
from lit_modules import OWN_DATA, build, loaders, write_wikitext

EPOCHS = {"boring": 2, "transformer": 2, "example_autoencoder": 3, "classifier": 3}


class MemoryLogger(L.loggers.Logger):
    """Every row Lightning's trainer hands its loggers."""

    name, version = "memory", 0

    def __init__(self):
        super().__init__()
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append(dict(metrics))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def lightning_trainer(name, callbacks=(), logger=False):
    return L.Trainer(max_epochs=EPOCHS[name], accelerator="cpu", devices=1, logger=logger, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     callbacks=list(callbacks))


def fit_data(name):
    return {} if name in OWN_DATA else dict(zip(("train_dataloaders", "val_dataloaders"), loaders(name, shuffle=False)))


def adapter_fit(name, run_dir):
    model = build(name)
    # checkpoints at epoch ends only: the kill tests check resuming (BoringModel has 64 batches an epoch)
    config = engine.TrainerConfig(max_epochs=EPOCHS[name], run_dir=str(run_dir), progress_bar="off",
                                  checkpoint=engine.CheckpointConfig(every_n_splits=None))
    trainer = engine.lightning.Trainer(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "has no validation_step", nothing else of the engine's
        warnings.filterwarnings("ignore", module="lightning|pytorch_lightning|torch")
        trainer.fit(model, **fit_data(name))
    lines = pathlib.Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return model, trainer, [json.loads(line) for line in lines]


def same_parameters(expected, actual):
    expected_state, state = expected.state_dict(), actual.state_dict()
    return list(expected_state) == list(state) and all(torch.equal(expected_state[key], state[key]) for key in state)


@pytest.mark.parametrize("name", OWN_DATA)
def test_lightnings_demo_modules_train_unchanged_as_under_lightnings_trainer(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_wikitext(str(tmp_path))  # LightningTransformer's data, so that it never downloads
    expected = build(name)
    lightning_trainer(name).fit(expected)
    model, trainer, rows = adapter_fit(name, tmp_path / "run")
    assert same_parameters(expected, model)
    validated = [row for row in rows if row.get("stage") == "val"]
    assert len(validated) == (EPOCHS[name] if name == "boring" else 0)  # BoringModel's validation_step runs
    assert (model.global_step, model.current_epoch) == (expected.global_step, expected.current_epoch)
    assert (trainer.global_step, trainer.current_epoch) == (expected.global_step, expected.current_epoch) != (0, 0)


class Record(L.Callback):
    """What Lightning's trainer showed of ``train`` after each training batch, and of
    ``validation`` after each validation pass, in its callback_metrics."""

    def __init__(self, train, validation):
        self.names, self.rows, self.passes = (train, validation), [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append(float(trainer.callback_metrics[self.names[0]]))


    def on_validation_end(self, trainer, pl_module):
        self.passes.append(float(trainer.callback_metrics.get(self.names[1], "nan")))


@pytest.mark.parametrize("name, logged", [("example_autoencoder", "val_loss"), ("classifier", "valid_loss")])
def test_modules_shaped_like_lightnings_basics_examples_train_as_under_lightnings_trainer(name, logged, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)  # where Lightning's ModelCheckpoint from configure_callbacks writes
    expected = build(name)
    step_name = "train_loss" if name == "example_autoencoder" else "train_loss_step"
    recorder = Record(step_name, logged)
    train, val = loaders(name, shuffle=False)
    logger = MemoryLogger()
    lightning = lightning_trainer(name, [recorder], logger)
    lightning.fit(expected, train, val)
    model, trainer, rows = adapter_fit(name, tmp_path / "run")
    assert same_parameters(expected, model)
    steps = [row["metrics"][step_name] for row in rows if row.get("stage") == "train"]
    assert torch.equal(torch.tensor(recorder.rows, dtype=torch.float64), torch.tensor(steps, dtype=torch.float64))
    passes = [row["metrics"][logged] for row in rows if row.get("stage") == "val"]
    assert len(passes) == len(recorder.passes) == (2 if name == "example_autoencoder" else EPOCHS[name])  # EarlyStopping
    if name == "classifier":  # on_step only: Lightning logs each batch's value, the adapter one per pass, their mean
        sizes = [len(x) for x, _ in val]
        per_batch = [row[logged] for row in logger.rows if logged in row]
        expected_passes = [sum(value * size for value, size in zip(per_batch[start:], sizes)) / sum(sizes)
                           for start in range(0, len(per_batch), len(sizes))]
        assert torch.equal(torch.tensor(passes, dtype=torch.float64), torch.tensor(expected_passes, dtype=torch.float64))
    else:  # on_step and on_epoch: the pass's value, summed in float64 where Lightning sums in float32
        assert torch.equal(torch.tensor(passes, dtype=torch.float32), torch.tensor(recorder.passes, dtype=torch.float32))
    # the hooks saw the same outputs, batches and indices (and self.log(on_step=True) was accepted)
    assert model.seen == expected.seen and len(model.seen) == len(passes) * 3
    _, test_loader = loaders(name, shuffle=False)
    tested, lightning_tested = trainer.test(model, test_loader), lightning.test(expected, test_loader)
    assert model.seen[len(passes) * 3:] == expected.seen[len(passes) * 3:]  # on_test_epoch_end: the fit's step
    assert set(lightning_tested[0]) <= set(tested[0])
    with pytest.raises(engine.ConfigError, match=r"Trainer.predict: not supported .*model.predict_step\(batch, batch_idx\)"):
        trainer.predict(model, test_loader)
