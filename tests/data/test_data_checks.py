"""A one-shot iterator (a generator) as training data is refused before training when more
than one epoch can run, with a message that says what to pass instead."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import engine
from engine.data.checks import check_reiterable
from models import Regression


def generate(count):
    for _ in range(count):
        yield torch.randn(3, 2)


@pytest.mark.parametrize("max_epochs", [2, None])
def test_a_generator_is_refused_before_any_step_when_several_epochs_can_run(max_epochs):
    module = Regression()
    config = engine.TrainerConfig(max_epochs=max_epochs, max_steps=100, progress_bar="off")
    with pytest.raises(engine.DataError, match=r"one-shot iterator \(generator\).*a torch DataLoader, a list of batches"):
        engine.Trainer(config).fit(module, generate(4))
    assert module.steps == 0


def test_a_generator_is_fine_for_one_epoch():
    module = Regression()
    result = engine.Trainer(engine.TrainerConfig(max_epochs=1, progress_bar="off")).fit(module, generate(4))
    assert result.epochs_completed == 1 and module.steps == 4


@pytest.mark.parametrize("data", [
    [torch.randn(3, 2)],
    (torch.randn(3, 2),),
    DataLoader(TensorDataset(torch.randn(6, 2)), batch_size=3),
])
def test_reiterable_data_passes(data):
    check_reiterable(data, max_epochs=5)


def test_any_iterator_is_refused():
    with pytest.raises(engine.DataError, match=r"one-shot iterator \(list_iterator\)"):
        check_reiterable(iter([torch.randn(3, 2)]), max_epochs=3)
