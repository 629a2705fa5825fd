"""splitloop's training-loop engine: composable loops, built-in TBPTT, exact split-level resume.

Public API (see docs/quickstart.md)::

    Trainer, TrainerConfig, CheckpointConfig, FitResult
    Rollback (TrainerConfig.anomaly: roll back past a non-finite or spiking loss)
    Watchdog (TrainerConfig.watchdog: hang detection, on by default)
    Module, LRSchedule, split_along_time
    Callback, RunView, EarlyStopping
    fingerprint, load_weights, export_weights
    preemption_safe (a DataLoader of your own whose workers outlive a preemption signal)
    errors: EngineError, ConfigError, ModuleContractError, SplitError, DataError, CheckpointError,
            CheckpointNotFound, CheckpointCorrupt, CheckpointIncompatible, CheckpointWriteError,
            WriterConflict, ReplicaDivergence, InjectedFault, AnomalyError
"""

# Names are imported on first use (PEP 562): ``import engine`` alone, or a process that needs
# one engine module (the writer process, engine.checkpoint.writers.process.main, runs without torch),
# does not import the whole engine and torch with it.
import importlib as _importlib
import importlib.util as _importlib_util
import typing as _typing

if _typing.TYPE_CHECKING:
    from engine.callbacks import Callback, RunView
    from engine.config import CheckpointConfig, Rollback, TrainerConfig, Watchdog
    from engine.callbacks.early_stopping import EarlyStopping
    from engine.errors import (
        AnomalyError,
        CheckpointCorrupt,
        CheckpointError,
        CheckpointIncompatible,
        CheckpointNotFound,
        CheckpointWriteError,
        ConfigError,
        DataError,
        EngineError,
        InjectedFault,
        ModuleContractError,
        SplitError,
        WriterConflict,
        ReplicaDivergence,
    )
    from engine.checkpoint.format.fingerprint import fingerprint
    from engine.module import Module
    from engine.loops.optim_setup import LRSchedule
    from engine.result import FitResult
    from engine.data.splitting import split_along_time
    from engine.run.preemption import preemption_safe
    from engine.trainer import Trainer
    from engine.weights import export_weights, load_weights

__all__ = [
    "AnomalyError",
    "Callback",
    "CheckpointConfig",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointIncompatible",
    "CheckpointNotFound",
    "CheckpointWriteError",
    "ConfigError",
    "DataError",
    "EarlyStopping",
    "EngineError",
    "FitResult",
    "InjectedFault",
    "LRSchedule",
    "Module",
    "ModuleContractError",
    "RunView",
    "SplitError",
    "Trainer",
    "TrainerConfig",
    "WriterConflict",
    "ReplicaDivergence",
    "Rollback",
    "Watchdog",
    "export_weights",
    "fingerprint",
    "load_weights",
    "preemption_safe",
    "split_along_time",
]


# module -> the names it gives (the same as the TYPE_CHECKING imports above; a test compares them)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "engine.callbacks": ("Callback", "RunView"),
    "engine.config": ("CheckpointConfig", "Rollback", "TrainerConfig", "Watchdog"),
    "engine.callbacks.early_stopping": ("EarlyStopping",),
    "engine.errors": (
        "AnomalyError", "CheckpointCorrupt", "CheckpointError", "CheckpointIncompatible", "CheckpointNotFound",
        "CheckpointWriteError", "ConfigError", "DataError", "EngineError", "InjectedFault", "ModuleContractError",
        "SplitError", "WriterConflict", "ReplicaDivergence",
    ),
    "engine.checkpoint.format.fingerprint": ("fingerprint",),
    "engine.module": ("Module",),
    "engine.loops.optim_setup": ("LRSchedule",),
    "engine.result": ("FitResult",),
    "engine.data.splitting": ("split_along_time",),
    "engine.run.preemption": ("preemption_safe",),
    "engine.trainer": ("Trainer",),
    "engine.weights": ("export_weights", "load_weights"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if not _typing.TYPE_CHECKING:  # hidden from mypy, which then still reports a misspelt name

    def __getattr__(name: str) -> object:
        """Import a public name's module the first time the name is used (PEP 562); a
        subpackage (``engine.loggers``, ``engine.faults``, ...) is imported on first use too,
        as ``import engine`` used to import them all."""
        module = _MODULE_OF.get(name)
        if module is not None:
            value = getattr(_importlib.import_module(module), name)
        elif not name.startswith("__") and _importlib_util.find_spec(f"engine.{name}") is not None:
            value = _importlib.import_module(f"engine.{name}")
        else:
            raise AttributeError(f"module 'engine' has no attribute {name!r}")
        globals()[name] = value  # later uses are plain attribute lookups
        return value

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(_MODULE_OF))
