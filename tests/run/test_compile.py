"""torch.compile: a module compiled as a whole (the engine compiles its training step) or with
compiled submodules trains and resumes exactly; checkpoints carry no ``_orig_mod.`` keys, so
compiled and uncompiled runs resume from each other's checkpoints.

Dynamo cannot trace ``nn.LSTM``, so the model here is a hand-written recurrent cell. Most
tests use the ``eager`` backend (same kernels as uncompiled code, so compiled and uncompiled runs
are bit-identical); one slow test uses inductor."""


import pytest
import torch

import engine
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from engine.loops.compiled import original_module, plain_key, training_step_of
from resume_helpers import assert_resumes_are_exact, assert_same_run, copy_run_until, memory_url
from scenarios import SPLIT, make_loader, seed_all


class ElmanCell(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input = torch.nn.Linear(3, 8)
        self.recurrent = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x, hidden):
        outputs = []
        for t in range(x.shape[1]):
            hidden = torch.tanh(self.input(x[:, t]) + self.recurrent(hidden))
            outputs.append(hidden)
        return torch.stack(outputs, dim=1), hidden


class RecurrentRegressor(engine.Module):
    tbptt_split_length = SPLIT

    def __init__(self):
        super().__init__()
        self.cell = ElmanCell()
        self.dropout = torch.nn.Dropout(0.2)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x, hidden):
        out, hidden = self.cell(x, hidden)
        return self.head(self.dropout(out)), hidden

    def training_step(self, batch, hidden=None):
        x, y = batch
        if hidden is None:
            hidden = torch.zeros(x.shape[0], 8)
        prediction, hidden = self(x, hidden)
        return torch.nn.functional.mse_loss(prediction, y), hidden

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizers": [optimizer],
                "schedulers": [engine.LRSchedule(torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.7), "step")]}


def make_model(compiled, backend="eager"):
    torch._dynamo.reset()  # fresh compile caches: each run compiles its own model
    seed_all(1234)
    model = RecurrentRegressor()
    if compiled == "whole":
        return torch.compile(model, backend=backend)
    if compiled == "submodule":
        model.cell = torch.compile(model.cell, backend=backend)
    return model


def train(run_dir, compiled, epochs=2, backend="eager"):
    model = make_model(compiled, backend)
    config = engine.TrainerConfig(max_epochs=epochs, run_dir=run_dir, progress_bar="off",
                                  checkpoint=engine.CheckpointConfig(keep_last=None))
    return model, engine.Trainer(config).fit(model, make_loader())


def test_plain_keys():
    assert plain_key("cell._orig_mod.input.weight") == "cell.input.weight"
    assert plain_key("_orig_mod.head.bias") == "head.bias"
    assert plain_key("head.bias") == "head.bias"


def test_compiling_the_whole_module_compiles_the_training_step():
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append({str(node.target) for node in graph_module.graph.nodes})
        return graph_module.forward

    model = make_model("whole", backend=recording_backend)
    assert original_module(model) is model._orig_mod
    assert training_step_of(model) is not model._orig_mod.training_step
    config = engine.TrainerConfig(max_epochs=1, run_dir=None, checkpoint=None, progress_bar="off")
    engine.Trainer(config).fit(model, make_loader())
    # The loss is computed in training_step, not in forward: it is in a compiled graph.
    assert any("mse_loss" in target for graph in graphs for target in graph)


@pytest.mark.parametrize("compiled", ["whole", "submodule"])
def test_compiled_run_checkpoints_have_plain_keys_and_equal_the_uncompiled_run(compiled):
    reference, compiled_dir = memory_url("compile"), memory_url("compile")
    train(reference, None)
    train(compiled_dir, compiled)
    state = CheckpointStore(Storage(compiled_dir)).latest().state
    assert not [key for key in state["module"] if "_orig_mod" in key]
    assert_same_run(reference, compiled_dir)


@pytest.mark.parametrize("compiled", ["whole", "submodule"])
def test_checkpoints_move_between_compiled_and_uncompiled_runs(compiled):
    """A compiled run resumes from an uncompiled run's checkpoint and the reverse; either way
    the result is the uninterrupted run's."""
    reference = memory_url("compile")
    train(reference, None)
    names = CheckpointStore(Storage(reference)).names()
    for writer, reader, checkpoint in [(None, compiled, names[5]), (compiled, None, names[17])]:
        source = memory_url("compile")
        train(source, writer)
        assert_resumes_are_exact(reference, [checkpoint], lambda run_dir: train(run_dir, reader)[1], source=source)


# CI time: inductor's C++ compile is the heaviest default test (about 40 s of CPU); the default run
# resumes compiled runs with the eager backend above (same graph capture, the kernels of eager mode).
@pytest.mark.exhaustive
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_inductor_compiled_run_resumes_exactly():
    """The real compiler (inductor, C++ on the CPU): a resumed compiled run recompiles the same
    kernels and ends bit-identical to the uninterrupted compiled run."""
    reference = memory_url("compile")
    train(reference, "whole", epochs=1, backend="inductor")
    names = CheckpointStore(Storage(reference)).names()
    resumed = memory_url("compile")
    copy_run_until(reference, resumed, names[5])
    _, result = train(resumed, "whole", epochs=1, backend="inductor")
    assert result.resumed_from == names[5]
    assert_same_run(reference, resumed)
