"""Lightning-style step parameters: a step that declares batch_idx / split_idx gets them (0-based,
as in the cursor and metrics.jsonl), also after a resume; the signature is read once per run."""

import inspect
import json

import torch

import engine
import engine.loops.step_output as step_output


class Recording(engine.Module):
    tbptt_split_length = 2

    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.RNN(1, 3, batch_first=True)
        self.seen = []

    def training_step(self, batch, hidden, batch_idx, split_idx):
        self.seen.append((batch_idx, split_idx))
        output, hidden = self.rnn(batch, hidden)
        return output.pow(2).mean(), hidden

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def sequences():
    torch.manual_seed(0)
    return [torch.randn(2, 6, 1) for _ in range(2)]  # 2 batches of 3 splits


def test_tbptt_step_gets_batch_and_split_indices_matching_the_metrics(tmp_path):
    module = Recording()
    config = engine.TrainerConfig(max_epochs=2, run_dir=str(tmp_path), progress_bar="off")
    engine.Trainer(config).fit(module, sequences())
    expected = [(batch, split) for _ in range(2) for batch in range(2) for split in range(3)]
    assert module.seen == expected
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(line["batch"], line["split"]) for line in metrics] == expected


def test_indices_continue_where_a_resumed_run_stopped(tmp_path):
    stopped = Recording()
    engine.Trainer(engine.TrainerConfig(max_epochs=None, max_steps=4, run_dir=str(tmp_path), progress_bar="off")).fit(stopped, sequences())
    assert stopped.seen == [(0, 0), (0, 1), (0, 2), (1, 0)]
    resumed = Recording()
    engine.Trainer(engine.TrainerConfig(max_epochs=1, run_dir=str(tmp_path), progress_bar="off")).fit(resumed, sequences())
    assert resumed.seen == [(1, 1), (1, 2)]


def test_batch_idx_without_tbptt_and_with_several_optimizers():
    class TwoOptimizers(engine.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
            self.seen = []

        def training_step(self, batch, optimizer_index, batch_idx):
            self.seen.append((batch_idx, optimizer_index))
            return (self.a if optimizer_index == 0 else self.b)(batch).pow(2).mean()

        def configure_optimizers(self):
            return [torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)]

    module = TwoOptimizers()
    engine.Trainer(engine.TrainerConfig(max_epochs=1, progress_bar="off")).fit(module, [torch.randn(3, 2)] * 3)
    assert module.seen == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_split_idx_is_zero_without_tbptt_and_keyword_only_parameters_work():
    class Plain(engine.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)
            self.seen = []

        def training_step(self, batch, *, split_idx):
            self.seen.append(split_idx)
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Plain()
    engine.Trainer(engine.TrainerConfig(max_epochs=1, progress_bar="off")).fit(module, [torch.randn(3, 2)] * 2)
    assert module.seen == [0, 0]


def test_the_signature_is_read_once_per_run(monkeypatch):
    calls = []
    real_signature = inspect.signature

    def counting_signature(function, *args, **kwargs):
        calls.append(getattr(function, "__name__", function))
        return real_signature(function, *args, **kwargs)

    monkeypatch.setattr(step_output.inspect, "signature", counting_signature)
    module = Recording()
    engine.Trainer(engine.TrainerConfig(max_epochs=2, progress_bar="off")).fit(module, sequences())
    assert len(module.seen) == 12 and calls.count("training_step") == 1
