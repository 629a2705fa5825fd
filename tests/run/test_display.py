"""The progress display: a start line, a tqdm bar per epoch on a terminal, timestamped log lines
otherwise, a summary line; 0-based indices as in the cursor and metrics.jsonl."""

import io
import json
import re
import time
import types

import torch

import engine
from engine.run.display import Display
from progress import Cursor

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d "


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def resumed_checkpoint(cursor, age_seconds):
    """What Display.start reads from a LoadedCheckpoint."""
    return types.SimpleNamespace(name="ckpt-0000000009", progress=types.SimpleNamespace(cursor=cursor),
                                 manifest=types.SimpleNamespace(created_unix=time.time() - age_seconds))


class Sequences(engine.Module):
    tbptt_split_length = 2

    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.RNN(1, 4, batch_first=True)
        self.head = torch.nn.Linear(4, 1)

    def training_step(self, batch, hidden):
        output, hidden = self.rnn(batch, hidden)
        return self.head(output).pow(2).mean(), hidden

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def sequences():
    torch.manual_seed(0)
    return [torch.randn(2, 4, 1) for _ in range(3)]  # 3 batches of 2 splits


def test_log_mode_lines_have_timestamp_percentage_rate_and_eta():
    stream = io.StringIO()
    display = Display("auto", log_every_seconds=0.000001, total_batches=6, stream=stream)
    display.start("runs/x", None)
    display.update(Cursor(0, 0, 0, 0), 1.5, 1)
    display.update(Cursor(0, 1, 0, 0), 1.25, 2)
    display.end_epoch(0)
    lines = stream.getvalue().splitlines()
    assert re.fullmatch(STAMP + r"splitloop: starting fresh in runs/x", lines[0])
    assert re.fullmatch(STAMP + r"splitloop: epoch 0 batch 1 split 0 \| 2/6 batches \(33%\) \| loss 1\.2500 \| step 2 \| "
                        r"elapsed \d\d:\d\d \| [\d.]+ batches/s \| epoch ETA (\d\d:\d\d|\?)", lines[2]), lines[2]
    assert "epoch 0 finished | 6/6 batches (100%)" in lines[3]
    assert "\r" not in stream.getvalue()


def test_bar_mode_is_a_tqdm_bar_per_epoch_on_a_terminal():
    stream = FakeTerminal()
    display = Display("auto", log_every_seconds=10.0, total_batches=4, stream=stream, tbptt=True)
    display.start("runs/x", None)
    display.update(Cursor(0, 2, 1, 0), 0.5, 7)
    display.end_epoch(0)
    display.finish(1, 8, None)
    text = stream.getvalue()
    assert "\repoch 0:  50%|" in text and "2/4 [" in text and "batch/s" in text or "s/batch" in text
    assert "batch 2 split 1 loss 0.5000 step 7" in text
    assert "epoch 0: 100%|" in text and "4/4" in text
    assert text.endswith("splitloop: done in 00:00: 1 epochs completed, 8 optimizer steps, 0 checkpoints written\n")


def test_bar_starts_at_the_resumed_position():
    stream = FakeTerminal()
    display = Display("bar", log_every_seconds=10.0, total_batches=10, stream=stream)
    display.start("runs/x", resumed_checkpoint(Cursor(3, 5, 0, 0), age_seconds=300))
    display.update(Cursor(3, 6, 0, 0), 0.5, 70)
    display.close()
    text = stream.getvalue()
    assert text.startswith("splitloop: resuming from ckpt-0000000009 in runs/x (written 5 min ago), "
                           "continuing after epoch 3 batch 5 split 0\n")
    first_bar = text.split("\r")[1]
    assert first_bar.startswith("epoch 3:  60%|") and "6/10" in first_bar


def test_log_lines_are_throttled():
    stream = io.StringIO()
    display = Display("log", log_every_seconds=3600.0, total_batches=1, stream=stream)
    for split in range(50):
        display.update(Cursor(0, 0, split, 0), 1.0, split)
    assert len(stream.getvalue().splitlines()) == 1


def test_off_prints_nothing():
    stream = FakeTerminal()
    display = Display("off", log_every_seconds=0.000001, total_batches=1, stream=stream)
    display.start("runs/x", resumed_checkpoint(Cursor(0, 0, 0, 0), 1))
    display.update(Cursor(0, 0, 0, 0), 1.0, 0)
    display.end_epoch(0)
    display.finish(1, 1, None)
    assert stream.getvalue() == ""


def test_fit_says_fresh_or_resumed_and_sums_up(tmp_path, capsys):
    config = engine.TrainerConfig(max_epochs=1, run_dir=str(tmp_path), progress_bar="log",
                                  checkpoint=engine.CheckpointConfig(keep_last=None))
    engine.Trainer(config).fit(Sequences(), sequences())
    first = capsys.readouterr().err
    assert f"splitloop: starting fresh in {tmp_path}\n" in first
    written = len(list((tmp_path / "checkpoints").iterdir()))
    assert re.search(rf"splitloop: done in \d\d:\d\d: 1 epochs completed, 6 optimizer steps, {written} checkpoints written\n", first)

    config.max_epochs = 2
    result = engine.Trainer(config).fit(Sequences(), sequences())
    second = capsys.readouterr().err
    assert (f"splitloop: resuming from {result.resumed_from} in {tmp_path} (written " in second
            and "ago), continuing after epoch 0 batch 2 split 1; the run had finished (max_epochs=1 reached); "
                "max_epochs 1 -> 2: training on\n" in second)
    assert "2 epochs completed, 12 optimizer steps" in second
    # One numbering: the display's indices are those of the cursor and metrics.jsonl.
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (metrics[6]["epoch"], metrics[6]["batch"], metrics[6]["split"]) == (1, 0, 0)
    assert "splitloop: epoch 1 batch 0 split 0 | 0/3 batches (0%)" in second

