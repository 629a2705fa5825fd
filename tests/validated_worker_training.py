"""worker_training.py's regression with a validation pass whose DataLoader has worker processes
(which augment each sample at random), for the preemption-during-validation tests.

Run as a script; with ``--pause-at N --handshake DIR`` the N-th validation batch of the run
writes ``DIR/validating`` and waits for ``DIR/go`` before it returns, so that a test knows a
validation pass is running (its workers alive) when it signals the process group. With
``--probe`` a callback iterates a loader of its own with workers (through
``engine.preemption_safe``) after the third split, and the pause is in its first batch instead::

    python tests/validated_worker_training.py RUN_DIR [--persistent] [--pause-at N | --probe] [--handshake DIR]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

import torch

import engine
from torch.utils.data import DataLoader

from writer_switch import trainer_config
from worker_training import WORKERS, AugmentedDataset, Regressor, make_loader, seed_all

VALIDATE_EVERY_STEPS = 4
HANDSHAKE_LIMIT_SECONDS = 120


class ValidatedRegressor(Regressor):
    """Validates on augmented samples; may pause inside one validation batch (see the module)."""

    def __init__(self, pause_at: int | None = None, handshake: pathlib.Path | None = None) -> None:
        super().__init__()
        self.pause_at, self.handshake, self.validation_batches = pause_at, handshake, 0

    def validation_step(self, batch: Any) -> torch.Tensor:
        self.validation_batches += 1
        if self.validation_batches == self.pause_at and self.handshake is not None:
            wait_for_go(self.handshake)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)


class Probe(engine.Callback):
    """Iterates a DataLoader of its own with worker processes after the third split (a user's
    extra evaluation), through ``engine.preemption_safe``; pauses in its first batch."""

    def __init__(self, handshake: pathlib.Path) -> None:
        self.handshake, self.splits = handshake, 0
        # Its own generator: the workers' base seed is not drawn from the run's random streams.
        loader = DataLoader(AugmentedDataset(), batch_size=4, num_workers=WORKERS, generator=torch.Generator())
        self.loader = engine.preemption_safe(loader)

    def on_split_end(self, view: engine.RunView) -> None:
        self.splits += 1
        if self.splits != 3:
            return
        for index, _ in enumerate(self.loader):
            if index == 0:
                wait_for_go(self.handshake)
        self.loader.close()


def wait_for_go(handshake: pathlib.Path) -> None:
    (handshake / "validating").write_text("")
    deadline = time.monotonic() + HANDSHAKE_LIMIT_SECONDS
    while not (handshake / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def train(run_dir: str, persistent: bool = False, pause_at: int | None = None,
          handshake: pathlib.Path | None = None, callbacks: tuple[engine.Callback, ...] = ()) -> engine.FitResult:
    """Two epochs, a validation every few steps and at each epoch end, checkpoints only after
    validations and at the stop (the preemption checkpoint is then easy to tell)."""
    seed_all(0)
    model = ValidatedRegressor(pause_at, handshake)
    config = trainer_config(max_epochs=2, run_dir=run_dir, progress_bar="off", val_every_n_steps=VALIDATE_EVERY_STEPS,
                            checkpoint=engine.CheckpointConfig(every_n_splits=1000, keep_last=None))
    val_data = DataLoader(AugmentedDataset(), batch_size=1, shuffle=True, num_workers=WORKERS,
                          persistent_workers=persistent)
    return engine.Trainer(config, callbacks).fit(model, make_loader(persistent), val_data)


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--pause-at", type=int, default=None, help="pause in this validation batch (1-based)")
    parser.add_argument("--probe", action="store_true", help="pause in a callback's own loader instead")
    parser.add_argument("--handshake", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    callbacks = (Probe(args.handshake),) if args.probe else ()
    result = train(args.run_dir, args.persistent, args.pause_at, args.handshake, callbacks)
    print(f"done {result.cursor}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
