"""Wrong arguments to Trainer, fit and split_along_time are typed errors raised before training,
not a TypeError from inside the engine (or, for val_data, after the first epoch)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine


class Validated(engine.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.steps = 0

    def training_step(self, batch):
        self.steps += 1
        return self.layer(batch).pow(2).mean()

    def validation_step(self, batch):
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _rows():
    return [torch.randn(2, 3, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def _config(**overrides):
    settings = {"max_epochs": 1, "progress_bar": "off"}
    settings.update(overrides)
    return engine.TrainerConfig(**settings)


@pytest.mark.parametrize("callbacks", [None, engine.EarlyStopping("val_loss")])
def test_callbacks_that_are_not_a_list_are_a_config_error(callbacks):
    with pytest.raises(engine.ConfigError, match=r"callbacks=\[callback\]"):
        engine.Trainer(_config(), callbacks=callbacks)


def test_val_data_that_is_not_iterable_is_refused_before_training():
    module = Validated()
    with pytest.raises(engine.DataError, match="val_data.*int"):
        engine.Trainer(_config()).fit(module, _rows(), 3)
    assert module.steps == 0


def test_val_every_n_steps_without_val_data_is_refused_before_training():
    module = Validated()
    with pytest.raises(engine.ConfigError, match="TrainerConfig.val_every_n_steps=2.*no val_data"):
        engine.Trainer(_config(val_every_n_steps=2)).fit(module, _rows())
    assert module.steps == 0
    assert engine.Trainer(_config(val_every_n_steps=2)).fit(module, _rows(), _rows()).metrics["val_loss"] >= 0


@pytest.mark.parametrize("split_length, time_dim", [(0, 1), (-2, 1), (2.0, 1), (True, 1), (2, 1.0), (2, "1")])
def test_split_along_time_with_bad_arguments_is_a_split_error(split_length, time_dim):
    with pytest.raises(engine.SplitError, match="split_along_time") as caught:
        engine.split_along_time(torch.zeros(2, 4, 3), split_length, time_dim)
    assert repr(split_length) in str(caught.value) or repr(time_dim) in str(caught.value)


class StopWith(engine.Callback):
    def __init__(self, reason) -> None:
        self.reason = reason

    def on_split_end(self, view):
        view.request_stop(self.reason)


@pytest.mark.parametrize("reason", [None, 3, "", "  "])
def test_request_stop_without_a_reason_string_is_a_contract_error(reason):
    # None used to be ignored silently (the run went on), 3 became FitResult.stop_reason.
    with pytest.raises(engine.ModuleContractError, match="RunView.request_stop") as caught:
        engine.Trainer(_config(), callbacks=[StopWith(reason)]).fit(Validated(), _rows())
    assert repr(reason) in str(caught.value)


def test_request_stop_with_a_reason_stops_and_reports_it():
    module = Validated()
    result = engine.Trainer(_config(), callbacks=[StopWith("enough")]).fit(module, _rows())
    assert result.stop_reason == "enough" and module.steps == 1


@pytest.mark.parametrize("data, says", [("abc", "single characters"), (b"abc", "single characters"),
                                        ({"x": torch.zeros(2, 3)}, "yields its keys"),
                                        (frozenset({1, 2}), "order is not fixed"),
                                        (torch.utils.data.TensorDataset(torch.zeros(4, 3)), "wrap it in torch.utils.data.DataLoader")])
def test_data_that_iterates_but_is_not_batches_is_a_data_error_before_training(data, says):
    module = Validated()
    with pytest.raises(engine.DataError, match=says) as caught:
        engine.Trainer(_config()).fit(module, data)
    assert type(data).__name__ in str(caught.value)
    assert module.steps == 0


def test_a_tensor_or_a_tuple_of_batches_still_trains():
    assert engine.Trainer(_config()).fit(Validated(), torch.zeros(4, 2, 3)).optimizer_steps == 4
    assert engine.Trainer(_config()).fit(Validated(), tuple(_rows())).optimizer_steps == 3


@pytest.mark.parametrize("resume", ["Auto", "yes", "latest ", "../other-run", ""])
def test_resume_that_is_no_keyword_nor_checkpoint_name_lists_the_choices(tmp_path, resume):
    # Without a run_dir this used to say that resume='yes' "needs TrainerConfig.run_dir".
    for run_dir in (None, str(tmp_path / "run")):
        with pytest.raises(engine.ConfigError, match="'auto', 'latest', 'off' or a checkpoint name") as caught:
            engine.Trainer(_config(run_dir=run_dir)).fit(Validated(), _rows(), resume=resume)
        assert repr(resume) in str(caught.value)
    assert not (tmp_path / "run").exists()


def test_val_data_that_would_never_be_validated_is_refused():
    module = Validated()
    with pytest.raises(engine.ConfigError, match="val_at_epoch_end=False and val_every_n_steps=None"):
        engine.Trainer(_config(val_at_epoch_end=False)).fit(module, _rows(), _rows())
    assert module.steps == 0
    result = engine.Trainer(_config(val_at_epoch_end=False, val_every_n_steps=3)).fit(module, _rows(), _rows())
    assert "val_loss" in result.metrics


@pytest.mark.parametrize("data", [[], torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(0, 3)))],
                         ids=["empty-list", "empty-dataloader"])
def test_empty_data_is_refused_before_the_run_dir_is_created(tmp_path, data):
    with pytest.raises(engine.DataError, match="empty"):
        engine.Trainer(_config(run_dir=str(tmp_path / "run"))).fit(Validated(), data)
    assert not (tmp_path / "run").exists()


class MisreportsItsLength:
    """Yields three batches but says five."""

    def __iter__(self):
        return iter(_rows())

    def __len__(self):
        return 5


def test_data_whose_len_is_not_what_it_yields_is_warned_about_once():
    with pytest.warns(UserWarning, match=r"len\(train_data\) is 5 but epoch 0 yielded 3 batches") as caught:
        result = engine.Trainer(_config(max_epochs=2)).fit(Validated(), MisreportsItsLength())
    assert result.optimizer_steps == 6
    assert sum("len(train_data)" in str(warning.message) for warning in caught) == 1


def test_data_whose_len_matches_trains_without_a_length_warning(recwarn):
    engine.Trainer(_config(max_epochs=2)).fit(Validated(), _rows())
    assert not [warning for warning in recwarn if "len(train_data)" in str(warning.message)]


# ---- keyword arguments of Trainer and fit -------------------------------------------------------
@pytest.mark.parametrize("keywords, says", [
    (dict(max_epochs=3), r"Trainer: unknown argument 'max_epochs'; it is a TrainerConfig field: "
                         r"Trainer\(TrainerConfig\(max_epochs=...\)\)"),
    (dict(max_epoch=3), r"did you mean max_epochs\? it is a TrainerConfig field"),
    (dict(accelerator="gpu"), r"Lightning's Trainer argument; here, in TrainerConfig: device="),
    (dict(callback=[]), r"did you mean callbacks\?"),
], ids=["config-field", "misspelt-config-field", "lightning", "callback"])
def test_trainer_keywords_that_belong_elsewhere_are_named(keywords, says):
    with pytest.raises(engine.ConfigError, match=says):
        engine.Trainer(**keywords)


@pytest.mark.parametrize("keywords, says", [
    (dict(ckpt_path="last"), r"'ckpt_path'; that is PyTorch Lightning's name; here: resume='ckpt-NNNNNNNNNN'.*"
                             r"resume='latest'"),
    (dict(val_dataloaders=[]), "here: val_data"),
    (dict(resum="off"), r"did you mean resume\?"),
], ids=["ckpt_path", "val_dataloaders", "resum"])
def test_fit_keywords_are_checked_before_anything_runs(tmp_path, keywords, says):
    module = Validated()
    run_dir = tmp_path / "run"
    with pytest.raises(engine.ConfigError, match=rf"fit: unknown argument .*{says}"):
        engine.Trainer(_config(run_dir=str(run_dir))).fit(module, _rows(), **keywords)
    assert module.steps == 0 and not run_dir.exists()


def test_checking_fits_keywords_keeps_its_warnings_pointing_at_the_caller(tmp_path):
    engine.Trainer(_config(run_dir=str(tmp_path))).fit(Validated(), _rows())
    with pytest.warns(UserWarning) as caught:  # also "metrics.jsonl of an earlier run is replaced"
        engine.Trainer(_config(run_dir=str(tmp_path))).fit(Validated(), _rows(), resume="off")
    assert [warning.filename for warning in caught if "resume='off': starting a fresh run" in str(warning.message)] \
        == [__file__]
