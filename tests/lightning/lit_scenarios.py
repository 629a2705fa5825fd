"""Train one of lit_modules' LightningModules through engine.lightning.Trainer into a run
directory; run as a script by the kill tests::

    python tests/lightning/lit_scenarios.py NAME RUN_DIR [--wandb DIR]

With ``--wandb DIR`` the trainer is given Lightning's ``WandbLogger(save_dir=DIR, offline=True)``.
"""

from __future__ import annotations

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (writer_switch), last

import torch
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint

import engine
import engine.lightning
import engine.loggers
from lit_modules import OWN_DATA, build, loaders, write_wikitext
from writer_switch import trainer_config

EPOCHS = 3


def callbacks(name: str, run_dir: str) -> list[object]:
    """ModelCheckpoint(save_top_k=2) and an EarlyStopping whose min_delta ends the run after its
    fourth validation (each pass must beat the best by 1.0, which none after the first does)."""
    if name != "checkpointed":
        return []
    return [ModelCheckpoint(monitor="val_loss", save_top_k=2, every_n_train_steps=2),
            EarlyStopping(monitor="val_loss", patience=3, min_delta=1.0)]


def loggers(name: str, run_dir: str) -> list[engine.loggers.Logger]:
    """The GRU language model also logs to TensorBoard and a CSV file, as a Lightning user's would."""
    if name != "gru_lm":
        return []
    return [engine.loggers.TensorBoard(os.path.join(run_dir, "tensorboard")),
            engine.loggers.CSV(os.path.join(run_dir, "metrics.csv"))]


def boring_settings(name: str) -> dict[str, object]:
    """BoringModel brings 64 batches of its own an epoch: two epochs, a checkpoint every 16 splits."""
    if name != "boring":
        return {}
    return {"max_epochs": 2, "checkpoint": engine.CheckpointConfig(every_n_splits=16)}


def train(name: str, run_dir: str, resume: str = "auto", logger: object = None) -> engine.FitResult:
    if name == "transformer":  # LightningTransformer reads ./data/wikitext-2.txt
        os.makedirs(f"{run_dir}-cwd", exist_ok=True)
        os.chdir(f"{run_dir}-cwd")
        write_wikitext(".")
    model = build(name)
    train_loader, val_loader = (None, None) if name in OWN_DATA else loaders(name)
    config = trainer_config(**{"max_epochs": EPOCHS, **boring_settings(name)}, run_dir=run_dir, progress_bar="off",
                            val_every_n_steps=3 if name == "checkpointed" else None, loggers=loggers(name, run_dir))
    trainer = engine.lightning.Trainer(config, callbacks=callbacks(name, run_dir), logger=logger)
    return trainer.fit(model, train_loader, None if name == "gan" else val_loader, resume=resume)


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    logger = None
    if argv[2:3] == ["--wandb"]:
        from pytorch_lightning.loggers import WandbLogger

        os.environ.pop("WANDB_SERVICE", None)  # its own wandb-core, not the test process's
        logger = WandbLogger(project="splitloop-tests", save_dir=argv[3], offline=True)
    result = train(argv[0], argv[1], logger=logger)
    print(f"done: {result.optimizer_steps} steps; {result.stop_reason}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
