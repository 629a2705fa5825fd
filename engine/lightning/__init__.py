"""Run an unmodified PyTorch Lightning ``LightningModule`` with the engine's guarantees.

``import engine.lightning`` imports Lightning (``pytorch_lightning``, and ``lightning.pytorch``
when installed: a module may derive from either); ``import engine`` never does. See
docs/lightning.md::

    from engine.lightning import Trainer
    Trainer(engine.TrainerConfig(max_epochs=3, run_dir="runs/lit")).fit(LitModel(), train_loader, val_loader)
"""

from engine.lightning._trainer import Trainer

__all__ = ["Trainer"]
