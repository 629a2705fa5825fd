"""Lightning's ``ModelCheckpoint`` and ``EarlyStopping`` translated to the engine's
``CheckpointConfig`` best-checkpoint options and :class:`engine.EarlyStopping`; any other
Lightning callback, or an option of these two the engine has no equivalent for, is refused."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

from engine.callbacks import Callback
from engine.callbacks.early_stopping import EarlyStopping
from engine.callbacks.hook_names import refuse_misnamed_hooks
from engine.config import CheckpointConfig, TrainerConfig
from engine.errors import ConfigError
from engine.lightning._packages import derives_from

# Options of ModelCheckpoint / EarlyStopping with no engine equivalent: (attribute, default, remedy).
_CHECKPOINT_REFUSED = (
    ("filename", None, "checkpoints are named ckpt-NNNNNNNNNN in TrainerConfig.run_dir"),
    ("save_weights_only", False, "every checkpoint holds the whole state; engine.export_weights writes the weights"),
    ("save_on_exception", False, "the engine checkpoints at every split"),
    ("_train_time_interval", None, "use CheckpointConfig(every_seconds=...)"),
    ("_save_on_train_epoch_end", None, "the engine checkpoints at every epoch end"),
)
_EARLY_STOPPING_REFUSED = (
    ("stopping_threshold", None, "no engine equivalent"),
    ("divergence_threshold", None, "no engine equivalent"),
    ("strict", True, "a missing monitored metric is always an error"),
)


@dataclasses.dataclass
class Translated:
    """The engine's view of the callbacks passed to engine.lightning.Trainer."""

    checkpoint: CheckpointConfig | None
    callbacks: list[Callback]


def translate_callbacks(callbacks: Sequence[object], config: TrainerConfig) -> Translated:
    """Engine callbacks pass through; ModelCheckpoint sets the checkpoint policy, EarlyStopping
    becomes engine.EarlyStopping; anything else is refused with ConfigError naming it."""
    checkpoint, engine_callbacks, seen_model_checkpoint = config.checkpoint, [], False
    for callback in callbacks:
        if isinstance(callback, Callback):
            refuse_misnamed_hooks([callback], "engine.lightning.Trainer")
            engine_callbacks.append(callback)
        elif derives_from(callback, "ModelCheckpoint"):
            if seen_model_checkpoint:
                raise ConfigError("engine.lightning.Trainer: more than one ModelCheckpoint; the engine keeps one "
                                  "checkpoint policy (CheckpointConfig): pass one")
            seen_model_checkpoint = True
            checkpoint = _checkpoint_config(callback, config)
        elif derives_from(callback, "EarlyStopping"):
            engine_callbacks.append(_early_stopping(callback))
        elif derives_from(callback, "Callback"):
            raise ConfigError(f"engine.lightning.Trainer: the Lightning callback {type(callback).__name__} is not "
                              "supported (ModelCheckpoint and EarlyStopping are; write an engine.Callback)")
        else:
            raise ConfigError(f"engine.lightning.Trainer: callbacks must be Lightning's ModelCheckpoint / "
                              f"EarlyStopping or engine.Callback objects, got {type(callback).__name__}")
    return Translated(checkpoint, engine_callbacks)


def _refuse_options(callback: Any, refused: tuple[tuple[str, Any, str], ...]) -> None:
    for attribute, default, remedy in refused:
        value = getattr(callback, attribute, default)
        if value != default:
            option = attribute.lstrip("_")
            raise ConfigError(f"{type(callback).__name__}({option}={value!r}): not supported by engine.lightning "
                              f"({remedy})")


def _checkpoint_config(callback: Any, config: TrainerConfig) -> CheckpointConfig:
    _refuse_options(callback, _CHECKPOINT_REFUSED)
    if callback.dirpath is not None and (config.run_dir is None
                                         or os.path.realpath(callback.dirpath) != os.path.realpath(config.run_dir)):
        raise ConfigError(f"ModelCheckpoint(dirpath={callback.dirpath!r}): checkpoints go to TrainerConfig.run_dir "
                          f"({config.run_dir!r}); drop dirpath or set run_dir to it")
    if callback._every_n_epochs not in (0, 1):
        raise ConfigError(f"ModelCheckpoint(every_n_epochs={callback._every_n_epochs!r}): not supported by "
                          "engine.lightning (the engine checkpoints at every epoch end)")
    base = config.checkpoint if config.checkpoint is not None else CheckpointConfig()
    every_n_steps = callback._every_n_train_steps or base.every_n_steps
    if callback.monitor is None:
        return dataclasses.replace(base, every_n_steps=every_n_steps)
    keep_all = callback.save_top_k == -1
    return dataclasses.replace(base, every_n_steps=every_n_steps, monitor=callback.monitor, mode=callback.mode,
                               keep_best=base.keep_best if keep_all else callback.save_top_k,
                               keep_last=None if keep_all else base.keep_last)


def _early_stopping(callback: Any) -> EarlyStopping:
    _refuse_options(callback, _EARLY_STOPPING_REFUSED)
    # Lightning keeps min_delta signed by mode (negative for "min").
    return EarlyStopping(monitor=callback.monitor, mode=callback.mode, patience=callback.patience,
                         min_delta=abs(float(callback.min_delta)),
                         check_on="epoch" if callback._check_on_train_epoch_end else "validation")
