"""A module that cannot train is refused before training, or at its first step, with a
ModuleContractError (or a ConfigError for a class attribute) that names the cause, instead of
an error from inside torch; an error raised inside the user's own TBPTT step says which split
it was and what hidden state the step got."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine
from misuse_helpers import Plain


def _fit(module, data, **config):
    settings = {"max_epochs": 1, "progress_bar": "off"}
    settings.update(config)
    return engine.Trainer(engine.TrainerConfig(**settings)).fit(module, data)


def _rows(count=3):
    return [torch.randn(2, 3, generator=torch.Generator().manual_seed(i)) for i in range(count)]


def _sequences(count=2, batch=2, time=5):
    return [torch.randn(batch, time, 3, generator=torch.Generator().manual_seed(i)) for i in range(count)]


class Recurrent(engine.Module):
    tbptt_split_length = 2

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 4, batch_first=True)

    def training_step(self, batch, hidden):
        output, hidden = self.rnn(batch, hidden)
        return output.pow(2).mean(), hidden

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_controls_train():
    assert _fit(Plain(), _rows()).optimizer_steps == 3
    assert _fit(Recurrent(), _sequences()).optimizer_steps == 6


class NoParameters(engine.Module):
    def training_step(self, batch):
        return batch.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)  # torch raises here: an empty parameter list


def test_module_without_parameters_is_refused_before_configure_optimizers():
    with pytest.raises(engine.ModuleContractError, match="NoParameters has no parameters"):
        _fit(NoParameters(), _rows())


def test_module_with_only_frozen_parameters_is_refused():
    module = Plain()
    module.layer.requires_grad_(False)
    with pytest.raises(engine.ModuleContractError, match="frozen"):
        _fit(module, _rows())


def test_partly_frozen_module_trains_its_other_parameters():
    module = Plain()
    module.layer.bias.requires_grad_(False)
    bias = module.layer.bias.detach().clone()
    assert _fit(module, _rows()).optimizer_steps == 3
    assert torch.equal(module.layer.bias, bias)


class Returns(Plain):
    def __init__(self, shape) -> None:
        super().__init__()
        self.shape = shape

    def training_step(self, batch):
        return self.shape(super().training_step(batch))


@pytest.mark.parametrize("shape", [lambda loss: loss.detach(), lambda loss: torch.tensor(loss.item()),
                                   lambda loss: torch.tensor(1)])
def test_loss_that_does_not_require_grad_is_a_contract_error(shape):
    with pytest.raises(engine.ModuleContractError, match="does not require grad"):
        _fit(Returns(shape), _rows())


def test_loss_computed_under_no_grad_is_a_contract_error():
    class NoGrad(Plain):
        def training_step(self, batch):
            with torch.no_grad():
                return super().training_step(batch)

    with pytest.raises(engine.ModuleContractError, match="no_grad"):
        _fit(NoGrad(), _rows())


def test_same_optimizer_returned_twice_is_refused():
    class Twice(Plain):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return [optimizer, optimizer]

    with pytest.raises(engine.ModuleContractError, match="same SGD twice"):
        _fit(Twice(), _rows())


def test_optimizer_over_tensors_outside_the_module_is_refused():
    outside = nn.Linear(3, 1)

    class Foreign(Plain):
        def configure_optimizers(self):
            return torch.optim.SGD([*self.parameters(), *outside.parameters()], lr=0.1)

    with pytest.raises(engine.ModuleContractError, match="2 tensor\\(s\\) that are not parameters of Foreign"):
        _fit(Foreign(), _rows())


def test_several_optimizers_need_a_step_that_takes_optimizer_index():
    class TwoOptimizers(Plain):
        def __init__(self) -> None:
            super().__init__()
            self.other = nn.Linear(3, 1)

        def training_step(self, batch):
            return (self.layer(batch) + self.other(batch)).pow(2).mean()

        def configure_optimizers(self):
            return [torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(self.other.parameters(), lr=0.1)]

    with pytest.raises(engine.ModuleContractError, match="'optimizer_index'.*several optimizers"):
        _fit(TwoOptimizers(), _rows())


def test_tbptt_needs_a_step_that_takes_hidden():
    class NoHidden(Recurrent):
        def training_step(self, batch):
            output, _ = self.rnn(batch)
            return output.pow(2).mean(), None

    with pytest.raises(engine.ModuleContractError, match="'hidden'.*TBPTT is on"):
        _fit(NoHidden(), _sequences())


def test_a_step_taking_keyword_arguments_gets_them():
    class Kwargs(Recurrent):
        def training_step(self, batch, **kwargs):
            return super().training_step(batch, kwargs["hidden"])

    assert _fit(Kwargs(), _sequences()).optimizer_steps == 6


@pytest.mark.parametrize("name, value", [("carry_hidden_across_batches", "yes"), ("carry_hidden_across_batches", 1),
                                         ("automatic_optimization", "no"), ("automatic_optimization", 0),
                                         ("tbptt_time_dim", True), ("tbptt_time_dim", "1"), ("tbptt_time_dim", 1.0)])
def test_module_attributes_of_the_wrong_type_are_named(name, value):
    module = Recurrent()
    setattr(module, name, value)
    with pytest.raises(engine.ConfigError) as caught:
        _fit(module, _sequences())
    assert f"Recurrent.{name}" in str(caught.value) and repr(value) in str(caught.value)


def test_error_in_a_tbptt_step_names_the_split_and_the_hidden_state_it_got():
    class WrongHidden(Recurrent):
        def training_step(self, batch, hidden):
            output, _ = self.rnn(batch, hidden)
            return output.pow(2).mean(), torch.zeros(1, 5, 4)  # batch size 5, the data's is 2

    with pytest.raises(RuntimeError) as caught:
        _fit(WrongHidden(), _sequences())
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "epoch 0 batch 0 split 1 (of 3)" in notes
    assert "the split was tensor(2, 2, 3)" in notes
    assert "the hidden state passed in was tensor(1, 5, 4)" in notes


def test_tuples_and_dicts_of_tensors_as_batches_train():
    class Pairs(Plain):
        def training_step(self, batch):
            features = batch[0] if isinstance(batch, (tuple, list)) else batch["features"]
            return super().training_step(features)

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(6, 3)), batch_size=2)
    assert _fit(Pairs(), loader).optimizer_steps == 3
    assert _fit(Pairs(), [{"features": rows} for rows in _rows()]).optimizer_steps == 3


def test_iterable_dataset_without_length_trains_every_epoch():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(torch.randn(6, 3, generator=torch.Generator().manual_seed(0)))

    loader = torch.utils.data.DataLoader(Stream(), batch_size=2)
    assert _fit(Plain(), loader, max_epochs=2).optimizer_steps == 6


class LogsInBoth(Plain):
    def __init__(self, training_name, validation_name) -> None:
        super().__init__()
        self.training_name, self.validation_name = training_name, validation_name

    def training_step(self, batch):
        loss = super().training_step(batch)
        self.log(self.training_name, 1000.0)
        return loss

    def validation_step(self, batch):
        self.log(self.validation_name, 0.5)
        return self.layer(batch).pow(2).mean()


@pytest.mark.parametrize("training_name, validation_name", [("val_loss", "acc"), ("acc", "acc")])
def test_a_metric_name_logged_in_training_and_validation_is_warned_about(training_name, validation_name):
    # The training value and the validation value overwrite each other in what
    # CheckpointConfig(monitor=...) and EarlyStopping read: the best checkpoints could follow 1000.0.
    module = LogsInBoth(training_name, validation_name)
    trainer = engine.Trainer(engine.TrainerConfig(max_epochs=1, progress_bar="off"))
    name = "val_loss" if training_name == "val_loss" else validation_name
    with pytest.warns(UserWarning, match=f"log\\('{name}'\\) in validation: the name was logged in training too"):
        trainer.fit(module, _rows(), _rows())


def test_distinct_training_and_validation_names_are_both_kept():
    result = engine.Trainer(engine.TrainerConfig(max_epochs=1, progress_bar="off")).fit(
        LogsInBoth("train_acc", "val_acc"), _rows(), _rows())
    assert result.metrics["train_acc"] == 1000.0 and result.metrics["val_acc"] == 0.5


@pytest.mark.parametrize("make", [NoParameters, lambda: nn.Linear(3, 1)], ids=["no-parameters", "no-training-step"])
def test_module_errors_come_before_the_run_dir_is_created(tmp_path, make):
    run_dir = tmp_path / "run"
    with pytest.raises(engine.ModuleContractError):
        _fit(make(), _rows(), run_dir=str(run_dir))
    assert not run_dir.exists()


@pytest.mark.parametrize("returned", [lambda loss: {"loss": loss}, lambda loss: {"los": loss}])
def test_a_step_returning_a_dict_is_told_to_return_the_loss(returned):
    with pytest.raises(engine.ModuleContractError, match=r"returned a dict with keys \['loss?s?'\]; return the loss tensor"):
        _fit(Returns(returned), _rows())


def test_a_tbptt_step_returning_lightnings_dict_is_told_to_return_a_tuple():
    class LightningStyle(Recurrent):
        def training_step(self, batch, hidden):
            loss, hidden = super().training_step(batch, hidden)
            return {"loss": loss, "hiddens": hidden}

    with pytest.raises(engine.ModuleContractError, match=r"keys \['hiddens', 'loss'\]; with TBPTT return the tuple"):
        _fit(LightningStyle(), _sequences())


def test_lightnings_hiddens_parameter_is_named_with_its_new_name():
    class LightningStyle(Recurrent):
        def training_step(self, batch, batch_idx, hiddens):
            return super().training_step(batch, hiddens)

    with pytest.raises(engine.ModuleContractError, match="rename Lightning's 'hiddens' to 'hidden'"):
        _fit(LightningStyle(), _sequences())


@pytest.mark.parametrize("returned, shown", [
    (lambda module: [[torch.optim.SGD(module.parameters(), lr=0.1)]], "got list[list[SGD]]"),
    (lambda module: torch.optim.SGD, "got the class SGD (not an instance: call it"),
    (lambda module: ([torch.optim.SGD(module.parameters(), lr=0.1)], None), "got tuple[list[SGD], None]"),
])
def test_odd_configure_optimizers_results_are_described_in_one_line(returned, shown):
    class Odd(Plain):
        def configure_optimizers(self):
            return returned(self)

    with pytest.raises(engine.ModuleContractError) as caught:
        _fit(Odd(), _rows())
    assert shown in str(caught.value)
    assert "\n" not in str(caught.value)  # an optimizer's repr spans lines ("Parameter Group 0 ...")


class LogsAndReturns(Plain):
    """validation_step logs ``logged`` with self.log and returns ``returned`` (a loss or a dict)."""

    def __init__(self, logged, returned) -> None:
        super().__init__()
        self.logged, self.returned = logged, returned

    def validation_step(self, batch):
        self.log(self.logged, 1.0)
        return self.returned(torch.tensor(2.0))


@pytest.mark.parametrize("returned, how", [(lambda loss: loss, r"returned by validation_step \(its loss"),
                                           (lambda loss: {"val_loss": loss}, "returned by validation_step in its dict")],
                         ids=["loss", "dict"])
def test_a_name_both_returned_and_logged_in_validation_is_refused(returned, how):
    # Before, the two were averaged silently: val_loss 1.5 from a logged 1.0 and a returned 2.0.
    trainer = engine.Trainer(engine.TrainerConfig(max_epochs=1, progress_bar="off"))
    with pytest.raises(engine.ModuleContractError,
                       match=rf"'val_loss' is both {how}.* and logged with self.log\('val_loss', ...\)"):
        trainer.fit(LogsAndReturns("val_loss", returned), _rows(), _rows())


def test_a_logged_name_beside_the_returned_loss_keeps_both_values():
    result = engine.Trainer(engine.TrainerConfig(max_epochs=1, progress_bar="off")).fit(
        LogsAndReturns("val_logged", lambda loss: loss), _rows(), _rows())
    assert result.metrics["val_loss"] == 2.0 and result.metrics["val_logged"] == 1.0
