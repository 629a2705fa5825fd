"""Lightning's classes, recognised in ``pytorch_lightning`` and in ``lightning.pytorch`` (the same
classes under two package names) by the classes a user's object derives from. Importing this
module imports Lightning (the first of the two installed); the other is never imported for
nothing: a module deriving from it has imported it already."""

from __future__ import annotations

import importlib

from engine.errors import ConfigError, ModuleContractError

PACKAGE_NAMES = ("pytorch_lightning", "lightning.pytorch")
# Where Lightning's own classes live (LightningModule's bases come from lightning_fabric), and torch's.
_LIGHTNING_ROOTS = ("pytorch_lightning", "lightning", "lightning_fabric", "torch")


def _import_one() -> None:
    for name in PACKAGE_NAMES:
        try:
            importlib.import_module(name)
            return
        except ImportError:
            continue
    raise ImportError("engine.lightning needs PyTorch Lightning: pip install 'splitloop[lightning]'")


_import_one()


def is_lightning_class(cls: type) -> bool:
    """Whether ``cls`` is defined by Lightning (or torch) rather than by the user."""
    return cls.__module__.split(".")[0] in _LIGHTNING_ROOTS


def derives_from(value: object, class_name: str) -> bool:
    """Whether ``value`` is an instance of Lightning's ``class_name`` from either package."""
    return any(klass.__name__ == class_name and klass.__module__.startswith(PACKAGE_NAMES)
               for klass in type(value).__mro__)


def require_lightning_module(model: object) -> None:
    if not derives_from(model, "LightningModule"):
        raise ModuleContractError(f"engine.lightning.Trainer expects a LightningModule (pytorch_lightning or "
                                  f"lightning.pytorch), got {type(model).__name__}; train an engine.Module with "
                                  "engine.Trainer")


def require_datamodule(value: object) -> None:
    if not derives_from(value, "LightningDataModule"):
        raise ConfigError(f"fit: datamodule must be a LightningDataModule, got {type(value).__name__}")
