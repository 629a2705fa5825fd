"""A small TBPTT run with validation, logged metrics and early stopping, for the fit-loop tests.

The model is the kill tests' SeqModel (shuffled data, dropout); its ``validation_step`` runs over
a *shuffled* validation loader and keeps functional dropout on, so validation draws random
numbers, which must never shift training's. Run as a script for the subprocess kill tests::

    python tests/validation_scenarios.py RUN_DIR [--every-steps N] [--patience P] [--sleep S] [--local-tier DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import engine
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from scenarios import SCENARIOS, TIME, FEATURES, build
from writer_switch import trainer_config

VAL_SAMPLES = 8


class ValidatedModel(engine.Module):
    """Wraps the scenario model's layers; logs a training metric and validates."""

    def __init__(self, inner: Any, val_dropout: bool = True) -> None:
        super().__init__()
        self.inner = inner
        self.tbptt_split_length = inner.tbptt_split_length
        self.val_dropout = val_dropout

    def training_step(self, batch: Any, hidden: Any = None) -> Any:
        loss, hidden = self.inner.forward_loss(batch, hidden, 0)
        self.log("train_abs_hidden", hidden[0].abs().mean(), reduce="max")
        self.log("train_loss_mean", loss)
        return loss, hidden

    def validation_step(self, batch: Any, hidden: Any = None) -> Any:
        x, y = batch
        out, hidden = self.inner.rnn(x, hidden)
        out = torch.nn.functional.dropout(out, 0.3, training=self.val_dropout)
        loss = torch.nn.functional.mse_loss(self.inner.head(out), y)
        self.log("val_max", loss, reduce="max")
        return {"val_loss": loss, "val_noise": torch.rand(()) if self.val_dropout else torch.zeros(())}, hidden

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def val_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(VAL_SAMPLES, TIME, FEATURES, generator=generator)
    y = x.cumsum(dim=1)[..., :1] * 0.1
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)


class Announce(engine.Callback):
    def __init__(self, sleep: float = 0.0) -> None:
        self.sleep = sleep

    def on_fit_start(self, view: engine.RunView) -> None:
        print("training", flush=True)

    def on_split_end(self, view: engine.RunView) -> None:
        time.sleep(self.sleep)


def build_validated(val_dropout: bool = True) -> tuple[ValidatedModel, DataLoader]:
    inner, loader = build("tbptt")
    return ValidatedModel(inner, val_dropout), loader


def train_validated(run_dir: str | None, epochs: int = 2, every_steps: int | None = 5, with_val: bool = True,
                    callbacks: tuple = (), checkpoint: Any = "default", **config: Any) -> tuple[ValidatedModel, engine.FitResult]:
    model, loader = build_validated()
    if checkpoint == "default":
        checkpoint = engine.CheckpointConfig(keep_last=None) if run_dir else None
    settings = dict(max_epochs=epochs, run_dir=run_dir, checkpoint=checkpoint, progress_bar="off",
                    val_every_n_steps=every_steps if with_val else None, gradient_clip_val=0.5)
    settings.update(config)
    trainer = engine.Trainer(trainer_config(**settings), callbacks=list(callbacks))
    result = trainer.fit(model, loader, val_loader() if with_val else None)
    return model, result


def best_policy(**overrides: Any) -> engine.CheckpointConfig:
    """What the kill tests run with: few newest checkpoints, the two best by val_loss kept."""
    settings: dict[str, Any] = dict(keep_last=2, monitor="val_loss", mode="min", keep_best=2)
    settings.update(overrides)
    return engine.CheckpointConfig(**settings)


def kept_best(run_dir: str) -> list[tuple[Any, Any, dict[str, torch.Tensor]]]:
    """The run's two kept best checkpoints, in the order of ``CheckpointStore.best``, by content:
    cursor, recorded monitor value, model tensors."""
    store = CheckpointStore(Storage(run_dir))
    kept = []
    for name in store.best(2):
        loaded = store.load(name)
        kept.append((loaded.progress.cursor, loaded.manifest.monitor, loaded.state["module"]))
    return kept


def fast_tier_policy(local_tier: str) -> engine.CheckpointConfig:
    """:func:`best_policy` with a fast tier, the durable tier written only at the run's end."""
    return best_policy(local_tier=local_tier, durable_every_n_splits=1000)


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--every-steps", type=int, default=5)
    parser.add_argument("--patience", type=int, default=0)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--local-tier", default=None)
    args = parser.parse_args(argv)
    callbacks: list[engine.Callback] = [Announce(args.sleep)]
    if args.patience:
        callbacks.append(engine.EarlyStopping(monitor="val_loss", mode="min", patience=args.patience))
    train_validated(args.run_dir, epochs=3, every_steps=args.every_steps, callbacks=tuple(callbacks),
                    checkpoint=best_policy() if args.local_tier is None else fast_tier_policy(args.local_tier))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
