"""The validated TBPTT run of validation_scenarios.py with two ReduceLROnPlateau schedulers that
really reduce the learning rate during the run: one stepped every third split with a training
metric (``interval="step"``, ``frequency=3``), one at each epoch end with ``val_loss``. The step
logs the learning rate it trains with, so metrics.jsonl holds the lr sequence. Run as a script
for the subprocess kill tests (the name is the configure_optimizers form)::

    python tests/plateau_scenario.py {lightning,schedule} RUN_DIR [--sleep S] [--loggers] [--mlflow URI EXPERIMENT] [--wandb DIR PROJECT]

With ``--loggers`` the run also writes TensorBoard events to RUN_DIR/tensorboard and a CSV to
RUN_DIR/metrics.csv (engine.loggers); with ``--mlflow`` it sends its rows to that MLflow server, with
``--wandb`` to an offline W&B run written under DIR.
"""

from __future__ import annotations

import sys

import argparse
import os
from typing import Any

import torch

import engine
from scenarios import build
from writer_switch import trainer_config
from validation_scenarios import Announce, ValidatedModel, val_loader

EPOCHS, EVERY_STEPS = 3, 5
STEP_FREQUENCY = 3


class PlateauModel(ValidatedModel):
    """Adam with two plateaus on it, in one of the accepted configure_optimizers forms."""

    def __init__(self, inner: Any, form: str) -> None:
        super().__init__(inner)
        self.form = form

    def training_step(self, batch: Any, hidden: Any = None) -> Any:
        optimizer = self.optimizers()
        assert isinstance(optimizer, torch.optim.Optimizer)
        self.log("lr", optimizer.param_groups[0]["lr"], reduce="last")
        return super().training_step(batch, hidden)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.02)
        # A large relative threshold: most checks count as "no improvement", so the lr drops often.
        by_split = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.7, patience=1, threshold=0.3)
        by_epoch = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.5)
        if self.form == "lightning":  # Lightning's ([optimizers], [lr_scheduler configs])
            return [optimizer], [
                {"scheduler": by_split, "monitor": "train_loss_mean", "interval": "step", "frequency": STEP_FREQUENCY},
                {"scheduler": by_epoch, "monitor": "val_loss", "interval": "epoch", "frequency": 1}]
        return {"optimizers": [optimizer], "schedulers": [
            engine.LRSchedule(by_split, "step", monitor="train_loss_mean", frequency=STEP_FREQUENCY),
            engine.LRSchedule(by_epoch, monitor="val_loss")]}


def run_loggers(run_dir: str) -> list[engine.loggers.Logger]:
    return [engine.loggers.TensorBoard(os.path.join(run_dir, "tensorboard")),
            engine.loggers.CSV(os.path.join(run_dir, "metrics.csv"))]


def train_plateau(run_dir: str | None, form: str = "schedule", callbacks: tuple = (), resume: str = "auto",
                  **config: Any) -> tuple[PlateauModel, engine.FitResult]:
    inner, loader = build("tbptt")
    model = PlateauModel(inner, form)
    settings: dict[str, Any] = dict(max_epochs=EPOCHS, run_dir=run_dir, progress_bar="off",
                                    checkpoint=engine.CheckpointConfig(keep_last=2) if run_dir else None,
                                    val_every_n_steps=EVERY_STEPS, gradient_clip_val=0.5)
    settings.update(config)
    result = engine.Trainer(trainer_config(**settings), callbacks=list(callbacks)).fit(model, loader, val_loader(),
                                                                                           resume=resume)
    return model, result


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("form", choices=["lightning", "schedule"])
    parser.add_argument("run_dir")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--loggers", action="store_true")
    parser.add_argument("--mlflow", nargs=2, metavar=("URI", "EXPERIMENT"))
    parser.add_argument("--wandb", nargs=2, metavar=("DIR", "PROJECT"))
    args = parser.parse_args(argv)
    loggers = run_loggers(args.run_dir) if args.loggers else []
    if args.mlflow:
        import mlflow.tracking  # noqa: F401  (imported before training: the sender connects at once)

        loggers.append(engine.loggers.MLflow(args.mlflow[0], experiment=args.mlflow[1], retry_seconds=0.2))
    if args.wandb:
        # Its own wandb-core, not the test process's (which its W&B runs would have exported here).
        os.environ.pop("WANDB_SERVICE", None)
        import wandb  # noqa: F401  (imported before training: the sender connects at once)

        loggers.append(engine.loggers.WandB(project=args.wandb[1], mode="offline", dir=args.wandb[0],
                                            retry_seconds=0.2))
    train_plateau(args.run_dir, args.form, callbacks=(Announce(args.sleep),), loggers=loggers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
