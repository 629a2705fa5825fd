"""splitloop's training-loop engine: composable loops, built-in TBPTT, exact split-level resume.

Public API (see docs/quickstart.md)::

    Trainer, TrainerConfig, CheckpointConfig, FitResult
    Rollback (TrainerConfig.anomaly: roll back past a non-finite or spiking loss)
    Module, LRSchedule, split_along_time
    Callback, RunView, EarlyStopping
    fingerprint, load_weights, export_weights
    preemption_safe (a DataLoader of your own whose workers outlive a preemption signal)
    errors: EngineError, ConfigError, ModuleContractError, SplitError, DataError, CheckpointError,
            CheckpointNotFound, CheckpointCorrupt, CheckpointIncompatible, CheckpointWriteError,
            WriterConflict, ReplicaDivergence, InjectedFault, AnomalyError
"""

from engine.callbacks import Callback, RunView
from engine.config import CheckpointConfig, Rollback, TrainerConfig
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
from engine.checkpoint.fingerprint import fingerprint
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
    "export_weights",
    "fingerprint",
    "load_weights",
    "preemption_safe",
    "split_along_time",
]
