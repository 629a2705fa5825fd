"""Resuming a checkpoint into a run that differs from the one that wrote it is refused with an
error naming the difference; nothing is partially restored."""

import uuid

import pytest
import torch
from torch.utils.data import DataLoader

import engine
import scenarios
from scenarios import SCENARIOS, SeqModel, build, make_dataset, train_with_checkpoints


@pytest.fixture
def run_dir():
    url = f"memory://incompatible-{uuid.uuid4().hex}"
    train_with_checkpoints("tbptt", url, epochs=1)
    return url


def fit(model, loader, run_dir, **config):
    settings = dict(max_epochs=2, run_dir=run_dir, progress_bar="off")
    settings.update(config)
    return engine.Trainer(engine.TrainerConfig(**settings)).fit(model, loader)


def test_changed_split_length(run_dir):
    model, loader = build("tbptt")
    model.tbptt_split_length = 8
    with pytest.raises(engine.CheckpointIncompatible, match="tbptt_split_length: checkpoint 4, this run 8"):
        fit(model, loader, run_dir)


def test_changed_model_shape(run_dir):
    model, loader = build("tbptt")
    model.head = torch.nn.Linear(8, 2)
    with pytest.raises(engine.CheckpointIncompatible, match="head.weight"):
        fit(model, loader, run_dir)


def test_changed_model_keys(run_dir):
    model, loader = build("tbptt")
    model.extra = torch.nn.Linear(2, 2)
    with pytest.raises(engine.CheckpointIncompatible, match="extra.weight"):
        fit(model, loader, run_dir)


def test_changed_optimizer_count(run_dir):
    model, loader = build("tbptt")
    model.scenario = SCENARIOS["tbptt_several_optimizers"]
    with pytest.raises(engine.CheckpointIncompatible, match="optimizers: checkpoint 1, this run 2"):
        fit(model, loader, run_dir)


def test_changed_data_length(run_dir):
    model, _ = build("tbptt")
    loader = DataLoader(make_dataset(), batch_size=2, shuffle=True)
    with pytest.raises(engine.CheckpointIncompatible, match="data_length: checkpoint 3, this run 6"):
        fit(model, loader, run_dir)


def test_nothing_is_restored_when_refused(run_dir):
    model, loader = build("tbptt")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.tbptt_split_length = 8
    with pytest.raises(engine.CheckpointIncompatible):
        fit(model, loader, run_dir)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
