"""Weights out of a run: load_weights into a module, export_weights to a plain state_dict file."""

import os

import pytest
import torch

import engine
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from scenarios import SeqModel, SCENARIOS, train_with_checkpoints


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("run"))
    train_with_checkpoints("tbptt", run_dir, epochs=1, keep_last=None)
    return run_dir


def latest_module_state(run_dir):
    return CheckpointStore(Storage(run_dir)).latest().state["module"]


def test_load_weights_latest_and_by_name(trained):
    model = SeqModel(SCENARIOS["tbptt"])
    name = engine.load_weights(model, trained)
    store = CheckpointStore(Storage(trained))
    assert name == store.names()[-1]
    for key, tensor in latest_module_state(trained).items():
        assert torch.equal(model.state_dict()[key], tensor)
    first = store.names()[0]
    assert engine.load_weights(model, trained, checkpoint=first) == first
    for key, tensor in store.load(first).state["module"].items():
        assert torch.equal(model.state_dict()[key], tensor)


def test_load_weights_skips_a_corrupt_newest_checkpoint(trained, tmp_path):
    import shutil

    run_dir = str(tmp_path / "copy")
    shutil.copytree(trained, run_dir)
    names = CheckpointStore(Storage(run_dir)).names()
    with open(os.path.join(run_dir, "checkpoints", names[-1], "tensors.bin"), "r+b") as handle:
        handle.seek(3)
        handle.write(b"\xff")
    with pytest.warns(UserWarning, match=names[-1]):
        assert engine.load_weights(SeqModel(SCENARIOS["tbptt"]), run_dir) == names[-2]


def test_a_different_architecture_is_refused_by_name(trained):
    class Other(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(3, 16, batch_first=True)

    with pytest.raises(engine.CheckpointIncompatible, match="model keys differ|rnn"):
        engine.load_weights(Other(), trained)


def test_export_is_a_plain_state_dict_that_torch_load_reads_with_weights_only(trained, tmp_path):
    path = str(tmp_path / "model.pt")
    name = engine.export_weights(trained, path)
    weights = torch.load(path, weights_only=True)
    assert name == CheckpointStore(Storage(trained)).names()[-1]
    saved = latest_module_state(trained)
    assert set(weights) == set(saved)
    for key in saved:
        assert torch.equal(weights[key], saved[key])
    fresh = SeqModel(SCENARIOS["tbptt"])
    fresh.load_state_dict(weights)


def test_export_as_safetensors_reads_back_with_load_file(trained, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = str(tmp_path / "model.safetensors")
    engine.export_weights(trained, path, format="safetensors")
    weights = safetensors_torch.load_file(path)
    saved = latest_module_state(trained)
    assert set(weights) == set(saved)
    for key in saved:
        assert torch.equal(weights[key], saved[key])


@pytest.mark.parametrize("call, error", [
    (lambda d: engine.export_weights(d, os.path.join(d, "model.bin"), format="pickle"), engine.ConfigError),
    (lambda d: engine.load_weights(object(), d), engine.ConfigError),
    (lambda d: engine.load_weights(SeqModel(SCENARIOS["tbptt"]), d + "-missing"), engine.CheckpointNotFound),
    (lambda d: engine.load_weights(SeqModel(SCENARIOS["tbptt"]), d, checkpoint="ckpt-x"), engine.CheckpointNotFound),
    (lambda d: engine.export_weights(d, d), engine.ConfigError),
])
def test_bad_input_gives_clear_errors(trained, call, error):
    with pytest.raises(error):
        call(trained)
