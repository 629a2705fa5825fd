"""The demo: a character-level LSTM language model trained with TBPTT on a text that ships with
the package. One epoch reads the text once as 8 parallel streams, in windows of 64 characters
cut into 4 splits of 16; the hidden state is carried from window to window."""

from __future__ import annotations

import random
from typing import Any
from importlib import resources

import torch
from torch.utils.data import DataLoader, Dataset

import engine

numpy: Any
try:
    import numpy
except ImportError:  # pragma: no cover
    numpy = None

STREAMS = 8
WINDOW = 64
SPLIT_LENGTH = 16


def load_corpus() -> str:
    return resources.files("engine.demo").joinpath("corpus.txt").read_text(encoding="utf-8")


class StreamWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Window ``i`` of the text cut into ``STREAMS`` parallel streams: (inputs, targets), each
    of shape (STREAMS, WINDOW), targets shifted by one character."""

    def __init__(self, text: str) -> None:
        self.vocabulary = sorted(set(text))
        codes = torch.tensor([self.vocabulary.index(c) for c in text], dtype=torch.long)
        per_stream = (len(codes) - 1) // STREAMS
        self.windows = per_stream // WINDOW
        usable = STREAMS * self.windows * WINDOW
        self.inputs = codes[:usable].view(STREAMS, -1)
        self.targets = codes[1:usable + 1].view(STREAMS, -1)

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = slice(index * WINDOW, (index + 1) * WINDOW)
        return self.inputs[:, window], self.targets[:, window]


class CharLSTM(engine.Module):
    """Embedding -> LSTM -> dropout -> linear, trained with TBPTT and carried hidden state."""

    tbptt_split_length = SPLIT_LENGTH
    carry_hidden_across_batches = True

    def __init__(self, vocabulary_size: int, embedding: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocabulary_size, embedding)
        self.rnn = torch.nn.LSTM(embedding, hidden, batch_first=True)
        self.dropout = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(hidden, vocabulary_size)

    def training_step(self, batch, hidden):
        inputs, targets = batch
        output, hidden = self.rnn(self.embed(inputs), hidden)
        logits = self.head(self.dropout(output))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return loss, hidden

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return {"optimizers": optimizer, "schedulers": [engine.LRSchedule(scheduler, interval="epoch")]}


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed)


def build_demo(seed: int) -> tuple[CharLSTM, DataLoader[Any]]:
    """The demo's model and data, initialized from ``seed``."""
    seed_everything(seed)
    dataset = StreamWindows(load_corpus())
    loader = DataLoader(dataset, batch_size=None, shuffle=False)
    return CharLSTM(len(dataset.vocabulary)), loader


def train(run_dir: str, epochs: str = "2", seed: str = "0", hang_timeout: str = "") -> engine.FitResult:
    """The demo as a training function for :mod:`engine.testing.harness` and ``python -m engine chaos``:
    checkpoints every split into ``run_dir`` and resumes from it. ``hang_timeout`` (seconds, ""
    for the defaults): the watchdog's ``min_timeout_s``, twice that before a phase is learned,
    so that a ``hang`` fault of ``chaos`` ends its attempt in seconds rather than minutes."""
    module, loader = build_demo(int(seed))
    watchdog = engine.Watchdog() if not hang_timeout else engine.Watchdog(
        min_timeout_s=float(hang_timeout), first_timeout_s=2 * float(hang_timeout))
    config = engine.TrainerConfig(max_epochs=int(epochs), run_dir=run_dir, progress_bar="off", watchdog=watchdog)
    return engine.Trainer(config).fit(module, loader)
