"""Which Lightning package a user's class comes from: ``pytorch_lightning`` or ``lightning.pytorch``
(the same classes under two names). Importing this module imports the installed one(s)."""

from __future__ import annotations

import importlib
import types

from engine.errors import ConfigError, ModuleContractError

PACKAGE_NAMES = ("pytorch_lightning", "lightning.pytorch")


def _import_installed() -> dict[str, types.ModuleType]:
    found = {}
    for name in PACKAGE_NAMES:
        try:
            found[name] = importlib.import_module(name)
        except ImportError:
            continue
    if not found:
        raise ImportError("engine.lightning needs PyTorch Lightning: pip install 'splitloop[lightning]'")
    return found


INSTALLED = _import_installed()


# Where Lightning's own classes live (LightningModule's bases come from lightning_fabric).
_LIGHTNING_ROOTS = ("pytorch_lightning", "lightning", "lightning_fabric", "torch")


def is_lightning_class(cls: type) -> bool:
    """Whether ``cls`` is defined by Lightning (or torch) rather than by the user."""
    return cls.__module__.split(".")[0] in _LIGHTNING_ROOTS


def package_of_module(model: object) -> types.ModuleType:
    """The Lightning package whose ``LightningModule`` ``model`` derives from."""
    for package in INSTALLED.values():
        if isinstance(model, package.LightningModule):
            return package
    raise ModuleContractError(f"engine.lightning.Trainer.fit expects a LightningModule (pytorch_lightning or "
                              f"lightning.pytorch), got {type(model).__name__}; train an engine.Module with engine.Trainer")


def package_of_object(value: object, class_name: str) -> types.ModuleType | None:
    """The Lightning package whose ``class_name`` ``value`` is an instance of, or None."""
    for package in INSTALLED.values():
        cls = getattr(package, class_name, None) or getattr(package.callbacks, class_name, None)
        if cls is not None and isinstance(value, cls):
            return package
    return None


def is_lightning_callback(value: object) -> bool:
    return any(isinstance(value, package.Callback) for package in INSTALLED.values())


def is_datamodule(value: object) -> bool:
    return any(isinstance(value, package.LightningDataModule) for package in INSTALLED.values())


def require_datamodule(value: object) -> None:
    if not is_datamodule(value):
        raise ConfigError(f"fit: datamodule must be a LightningDataModule, got {type(value).__name__}")
