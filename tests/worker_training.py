"""A tiny regression fed by a DataLoader with worker processes that augment each sample at
random in ``__getitem__`` (Python ``random``, torch and NumPy), as random crops or masking do.

Run as a script to train into a run directory (used by the subprocess kill and preemption
tests); it prints ``training`` once the first split is done::

    python tests/worker_training.py RUN_DIR [--persistent] [--epochs N] [--sleep SECONDS] [--every N]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

import numpy
import torch
from torch.utils.data import DataLoader, Dataset

import engine
from writer_switch import trainer_config

SAMPLES, BATCH, FEATURES, WORKERS = 12, 2, 4, 2


class AugmentedDataset(Dataset):
    """Fixed samples, augmented at random on every load."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(SAMPLES, FEATURES, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        mask = (torch.rand(FEATURES) > 0.25).float()
        shift = random.gauss(0.0, 0.1) + float(numpy.random.normal(0.0, 0.1))
        return self.x[index] * mask + shift, self.y[index]


class Regressor(engine.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(FEATURES, 1)
        self.dropout = torch.nn.Dropout(0.2)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(self.dropout(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.5)


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


def make_loader(persistent: bool = False, workers: int = WORKERS, **options: Any) -> DataLoader:
    options.setdefault("shuffle", True)
    return DataLoader(AugmentedDataset(), batch_size=BATCH, num_workers=workers,
                      persistent_workers=persistent and workers > 0, **options)


def train(run_dir: str, persistent: bool = False, epochs: int = 2, callbacks: tuple = (),
          resume: str = "auto", every: int = 1, **settings: Any) -> engine.FitResult:
    """Train into ``run_dir`` with a checkpoint every ``every`` batches."""
    seed_all(0)
    model = Regressor()
    loader = make_loader(persistent)
    config = dict(max_epochs=epochs, run_dir=run_dir, progress_bar="off",
                  checkpoint=engine.CheckpointConfig(every_n_splits=every, keep_last=None))
    config.update(settings)
    return engine.Trainer(trainer_config(**config), callbacks=list(callbacks)).fit(model, loader, resume=resume)


class AnnounceAndSlowDown(engine.Callback):
    """Prints 'training' after the first split and sleeps after every split (changes no number)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.announced = False

    def on_split_end(self, view: engine.RunView) -> None:
        if not self.announced:
            print("training", flush=True)
            self.announced = True
        time.sleep(self.seconds)


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--every", type=int, default=1, help="checkpoint every N batches")
    args = parser.parse_args(argv)
    result = train(args.run_dir, args.persistent, args.epochs, callbacks=(AnnounceAndSlowDown(args.sleep),),
                   every=args.every)
    print(f"done {result.cursor}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
