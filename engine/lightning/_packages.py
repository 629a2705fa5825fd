"""Lightning's classes, recognised in ``pytorch_lightning`` and in ``lightning.pytorch`` (the same
classes under two package names) by the classes a user's object derives from. Importing this
module imports Lightning (the first of the two installed); the other is never imported for
nothing: a module deriving from it has imported it already."""

from __future__ import annotations

import functools
import importlib
import sys

from engine.errors import ConfigError, ModuleContractError

PACKAGE_NAMES = ("pytorch_lightning", "lightning.pytorch")
# The framework's base classes: a class in their MROs (hook mixins, torch's Module, object) is
# Lightning's own; any other, even one shipped inside the lightning package (its demos'
# BoringModel), is a user's module whose overrides count.
_FRAMEWORK_BASES = ("LightningModule", "LightningDataModule")


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
    """Whether ``cls`` is one of Lightning's framework classes (``LightningModule``,
    ``LightningDataModule`` or a class they derive from, torch's included), decided by identity:
    a module shipped inside the ``lightning`` package, such as its demos, is not one."""
    return cls in _framework_classes(tuple(sys.modules.get(name) for name in PACKAGE_NAMES))


@functools.cache
def _framework_classes(packages: tuple[object, ...]) -> frozenset[type]:
    """The framework bases of the Lightning packages imported so far, with their MROs."""
    return frozenset(klass for package in packages if package is not None for base in _FRAMEWORK_BASES
                     for klass in getattr(package, base).__mro__)


def overrides(value: object, name: str) -> bool:
    """Whether the user's class (not Lightning's framework classes) defines ``name``."""
    owner = next((klass for klass in type(value).__mro__ if name in vars(klass)), None)
    return owner is not None and not is_lightning_class(owner)


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
    """Refuse a ``datamodule`` that is not a LightningDataModule (None, no datamodule, is fine)."""
    if value is not None and not derives_from(value, "LightningDataModule"):
        raise ConfigError(f"fit: datamodule must be a LightningDataModule, got {type(value).__name__}")
