"""Bad input gets a clear, typed error that says what was wrong."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import engine
from engine import faults
from engine.checkpoint.format.names import check_name


@pytest.fixture(autouse=True)
def _no_armed_faults(monkeypatch):
    monkeypatch.delenv(faults.ENVIRONMENT_VARIABLE, raising=False)
    faults.clear()
    yield
    faults.clear()


def _config(**overrides) -> engine.TrainerConfig:
    settings = {"run_dir": None, "checkpoint": None, "progress_bar": "off"}
    settings.update(overrides)
    return engine.TrainerConfig(**settings)


def _fit(module, data, **config):
    return engine.Trainer(_config(**config)).fit(module, data)


class PlainModel(engine.Module):
    """No TBPTT; ``shape_output(loss)`` decides what the step returns."""

    def __init__(self, shape_output=lambda loss: loss) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.shape_output = shape_output

    def training_step(self, batch):
        return self.shape_output(self.layer(batch).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RecurrentModel(engine.Module):
    """TBPTT with splits of 2 time steps; ``shape_output(loss, hidden)`` decides what the step returns."""

    tbptt_split_length = 2

    def __init__(self, shape_output=lambda loss, hidden: (loss, hidden)) -> None:
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True)
        self.shape_output = shape_output

    def training_step(self, batch, hidden):
        output, hidden = self.rnn(batch, hidden)
        return self.shape_output(output.pow(2).mean(), hidden)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _sequences(batch=2, time=4, features=3):
    return [torch.randn(batch, time, features, generator=torch.Generator().manual_seed(0))]


def _rows():
    return [torch.randn(2, 3, generator=torch.Generator().manual_seed(1))]


# ---- controls: the same models and data train when nothing is wrong ----------------------


def test_control_plain_model_trains():
    result = _fit(PlainModel(), _rows() * 3)
    assert result.optimizer_steps == 3
    assert result.epochs_completed == 1


def test_control_recurrent_model_trains():
    result = _fit(RecurrentModel(), _sequences(time=4))
    assert result.optimizer_steps == 2  # 4 time steps in splits of 2
    assert result.cursor.as_tuple() == (0, 0, 1, 0)


# ---- module contract ---------------------------------------------------------------------


@pytest.mark.parametrize("length", [0, -3, 2.5, "4", True])
def test_bad_tbptt_split_length_is_a_config_error(length):
    module = RecurrentModel()
    module.tbptt_split_length = length
    with pytest.raises(engine.ConfigError) as caught:
        _fit(module, _sequences())
    message = str(caught.value)
    assert "tbptt_split_length" in message
    assert repr(length) in message


def test_step_returning_hidden_while_tbptt_is_off():
    module = PlainModel(shape_output=lambda loss: (loss, torch.zeros(1)))
    with pytest.raises(engine.ModuleContractError, match="TBPTT"):
        _fit(module, _rows())


def test_tbptt_step_returning_only_a_loss():
    module = RecurrentModel(shape_output=lambda loss, hidden: loss)
    with pytest.raises(engine.ModuleContractError, match=r"\(loss, hidden\)"):
        _fit(module, _sequences())


def test_tbptt_step_returning_none_as_hidden():
    module = RecurrentModel(shape_output=lambda loss, hidden: (loss, None))
    with pytest.raises(engine.ModuleContractError, match="hidden state") as caught:
        _fit(module, _sequences())
    assert "None" in str(caught.value)


@pytest.mark.parametrize("shape_output", [lambda loss: loss.reshape(1), lambda loss: loss.expand(3),
                                          lambda loss: loss.item(), lambda loss: None, lambda loss: "0.5"],
                         ids=["1-d-tensor", "3-vector", "float", "none", "string"])
def test_loss_that_is_not_a_scalar_tensor(shape_output):
    with pytest.raises(engine.ModuleContractError, match="scalar"):
        _fit(PlainModel(shape_output=shape_output), _rows())


def test_tbptt_loss_that_is_not_a_scalar_tensor():
    module = RecurrentModel(shape_output=lambda loss, hidden: (loss.reshape(1), hidden))
    with pytest.raises(engine.ModuleContractError, match="scalar"):
        _fit(module, _sequences())


@pytest.mark.parametrize(
    "returned",
    [lambda module: "sgd", lambda module: None, lambda module: [], lambda module: module,
     lambda module: [torch.optim.SGD(module.parameters(), lr=0.1), "adam"],
     lambda module: {"optimisers": torch.optim.SGD(module.parameters(), lr=0.1)}],
    ids=["string", "none", "empty-list", "a-module", "list-with-string", "dict-wrong-key"],
)
def test_configure_optimizers_returning_something_else(returned):
    module = PlainModel()
    module.configure_optimizers = lambda: returned(module)
    with pytest.raises(engine.ModuleContractError, match="configure_optimizers"):
        _fit(module, _rows())


def test_scheduler_of_another_optimizer_is_refused():
    module = PlainModel()
    stranger = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(stranger, step_size=1)
    module.configure_optimizers = lambda: {"optimizers": torch.optim.SGD(module.parameters(), lr=0.1),
                                           "schedulers": [scheduler]}
    with pytest.raises(engine.ModuleContractError, match="StepLR"):
        _fit(module, _rows())


@pytest.mark.parametrize("not_a_module", [object(), "model", lambda batch: batch, torch.zeros(2)],
                         ids=["object", "string", "function", "tensor"])
def test_fit_of_something_that_is_not_an_nn_module(not_a_module):
    with pytest.raises(engine.ModuleContractError, match="torch.nn.Module") as caught:
        _fit(not_a_module, _rows())
    assert type(not_a_module).__name__ in str(caught.value)


def test_fit_of_an_nn_module_without_training_step():
    with pytest.raises(engine.ModuleContractError, match="training_step"):
        _fit(nn.Linear(3, 1), _rows())


def test_carry_hidden_across_batches_without_tbptt():
    module = PlainModel()
    module.carry_hidden_across_batches = True
    with pytest.raises(engine.ConfigError, match="carry_hidden_across_batches"):
        _fit(module, _rows())


# ---- batches the default splitter cannot split -------------------------------------------


def test_batch_without_tensors_cannot_be_split():
    with pytest.raises(engine.SplitError, match="no tensor") as caught:
        _fit(RecurrentModel(), [["some", "strings"]])
    assert "list" in str(caught.value)


def test_tensors_with_different_time_lengths_cannot_be_split():
    batch = (torch.zeros(2, 4, 3), torch.zeros(2, 5))
    with pytest.raises(engine.SplitError) as caught:
        _fit(RecurrentModel(), [batch])
    message = str(caught.value)
    assert "4" in message and "5" in message


def test_tensor_without_the_time_dim_cannot_be_split():
    with pytest.raises(engine.SplitError) as caught:
        _fit(RecurrentModel(), [torch.zeros(5)])
    message = str(caught.value)
    assert "(5,)" in message
    assert "time dim 1" in message


def test_split_error_is_a_module_contract_error():
    assert issubclass(engine.SplitError, engine.ModuleContractError)


def test_split_along_time_rejects_directly():
    with pytest.raises(engine.SplitError):
        engine.split_along_time({"x": torch.zeros(2, 0, 3)}, 2)
    with pytest.raises(engine.SplitError):
        engine.split_along_time(torch.zeros(()), 2)


# ---- data --------------------------------------------------------------------------------


class _EmptyStream(IterableDataset):
    def __iter__(self):
        return iter(())


@pytest.mark.parametrize(
    "data",
    [[], (), DataLoader(TensorDataset(torch.zeros(0, 3)), batch_size=2)],
    ids=["empty-list", "empty-tuple", "empty-dataloader"],
)
def test_empty_data_is_a_data_error(data):
    with pytest.raises(engine.DataError, match="empty"):
        _fit(PlainModel(), data)


def test_data_without_length_that_yields_nothing_is_a_data_error():
    with pytest.raises(engine.DataError, match="no batch"):
        _fit(PlainModel(), DataLoader(_EmptyStream(), batch_size=None))


@pytest.mark.parametrize("data", [5, None, 2.5])
def test_data_that_is_not_iterable_is_a_data_error(data):
    with pytest.raises(engine.DataError, match="iterable") as caught:
        _fit(PlainModel(), data)
    assert type(data).__name__ in str(caught.value)


# ---- trainer configuration ---------------------------------------------------------------


def test_no_stop_condition():
    with pytest.raises(engine.ConfigError, match="stop condition"):
        _config(max_epochs=None)


@pytest.mark.parametrize(
    "field, value",
    [("max_epochs", 0), ("max_epochs", -2), ("max_epochs", 1.5), ("max_epochs", True), ("max_steps", -1),
     ("max_steps", 0), ("max_time", 0), ("max_time", float("nan")), ("max_time", float("inf")),
     ("accumulate_grad", 0), ("accumulate_grad", None), ("accumulate_grad", 2.0), ("accumulate_over", "epochs"),
     ("gradient_clip_val", -1), ("gradient_clip_val", 0), ("gradient_clip_algorithm", "x"),
     ("progress_bar", "x"), ("log_every_seconds", 0), ("run_dir", ""), ("run_dir", 3),
     ("checkpoint", {"every_n_splits": 1}), ("preemption_exit_code", 256), ("preemption_exit_code", -1)],
)
def test_bad_trainer_config_field_is_named(field, value):
    with pytest.raises(engine.ConfigError) as caught:
        _config(**{field: value})
    message = str(caught.value)
    assert f"TrainerConfig.{field}" in message
    assert repr(value) in message


@pytest.mark.parametrize("bad_signal", [9, 19, 10_000])  # SIGKILL and SIGSTOP cannot be caught
def test_uncatchable_preemption_signal_is_named(bad_signal):
    with pytest.raises(engine.ConfigError) as caught:
        _config(preemption_signals=(15, bad_signal))
    message = str(caught.value)
    assert "TrainerConfig.preemption_signals" in message
    assert str(bad_signal) in message


@pytest.mark.parametrize(
    "field, value",
    [("every_n_splits", 0), ("every_n_steps", -1), ("every_seconds", 0), ("keep_last", 0), ("max_in_flight", 0),
     ("max_in_flight", None), ("when_behind", "drop"), ("on_io_error", "ignore")],
)
def test_bad_checkpoint_config_field_is_named(field, value):
    with pytest.raises(engine.ConfigError) as caught:
        engine.CheckpointConfig(**{field: value})
    message = str(caught.value)
    assert f"CheckpointConfig.{field}" in message
    assert repr(value) in message


def test_trainer_refuses_a_config_that_is_not_a_trainer_config():
    with pytest.raises(engine.ConfigError, match="TrainerConfig"):
        engine.Trainer({"max_epochs": 1})


def test_trainer_refuses_callbacks_that_are_not_callbacks():
    with pytest.raises(engine.ConfigError, match="Callback"):
        engine.Trainer(_config(), callbacks=[object()])


def test_fit_refuses_a_resume_that_is_not_a_string():
    with pytest.raises(engine.ConfigError, match="resume"):
        engine.Trainer(_config()).fit(PlainModel(), _rows(), resume=True)


def test_config_error_is_a_value_error():
    assert issubclass(engine.ConfigError, ValueError)
    assert issubclass(engine.ModuleContractError, TypeError)


# ---- fault specifications ----------------------------------------------------------------


def test_parse_faults_control():
    parsed = faults.parse_faults("split_end:7:sigkill, checkpoint_before_manifest:1:eio")
    assert [(f.point, f.hit, f.kind) for f in parsed] == [("split_end", 7, "sigkill"),
                                                          ("checkpoint_before_manifest", 1, "eio")]


def test_parse_faults_unknown_point():
    with pytest.raises(engine.ConfigError, match="'nowhere'"):
        faults.parse_faults("nowhere:1:raise")


def test_parse_faults_unknown_kind():
    with pytest.raises(engine.ConfigError, match="'explode'"):
        faults.parse_faults("split_end:1:explode")


@pytest.mark.parametrize("text", ["split_end", "split_end:1", "split_end:x:raise", "split_end:-1:raise",
                                  "split_end:1:raise:extra", "split_end::raise", ":1:raise",
                                  "split_end:1.5:raise"])
def test_parse_faults_bad_syntax(text):
    with pytest.raises(engine.ConfigError) as caught:
        faults.parse_faults(text)
    assert text.split(":")[0] in str(caught.value)


def test_parse_faults_hit_zero():
    with pytest.raises(engine.ConfigError, match="hit"):
        faults.parse_faults("split_end:0:raise")


def test_parse_faults_non_ascii_digit_is_a_config_error():
    with pytest.raises(engine.ConfigError):
        faults.parse_faults("split_end:²:raise")


def test_bad_fault_in_the_environment_fails_fit(monkeypatch):
    monkeypatch.setenv(faults.ENVIRONMENT_VARIABLE, "split_end:1:explode")
    with pytest.raises(engine.ConfigError, match="explode"):
        _fit(PlainModel(), _rows())


# ---- storage names -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "..", "", "a\\b", "a b", "/abs", "x/../y", 3, None])
def test_check_name_refuses_paths_and_hidden_names(name):
    with pytest.raises(engine.ConfigError) as caught:
        check_name(name)
    assert repr(name) in str(caught.value)


def test_check_name_accepts_plain_names():
    for name in ("ckpt-0000000001", "MANIFEST.json", "tensors.bin", "a_b-c.d"):
        assert check_name(name) == name


def test_check_name_refuses_a_trailing_newline():
    with pytest.raises(engine.ConfigError):
        check_name("tensors.bin\n")


def test_reduce_lr_on_plateau_without_a_monitor_is_refused_with_advice():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    with pytest.raises(engine.ModuleContractError, match="ReduceLROnPlateau is stepped with a metric: name it, "
                                                         "engine.LRSchedule\\(scheduler, monitor='val_loss'\\)"):
        engine.LRSchedule(plateau)
