"""The run's hyperparameters as the trackers log them (MLflow params, W&B config): flat
``name -> text`` pairs, the TrainerConfig's fields as ``config/<field>`` and the module's
``hparams`` (what a LightningModule's ``save_hyperparameters()`` recorded, or an ``hparams``
mapping on an engine module) as ``hparams/<name>``. Nested mappings are flattened with ``/``."""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from engine.loggers.base import RunFiles, RunInfo

# A tracker keeps a parameter value up to a limit (MLflow: 6000 characters; 500 on older servers).
MAX_VALUE_CHARACTERS = 500
_SKIPPED_FIELDS = ("loggers",)  # the loggers themselves are not a setting of the training


def run_info(files: RunFiles | None, config: object, module: object,
             export_weights: Callable[[str], str] | None = None) -> RunInfo:
    """What the loggers are told about the run (engine.loggers.base.Logger.bind)."""
    return RunInfo(files, run_hyperparameters(config, module), export_weights)


def run_hyperparameters(config: object, module: object) -> dict[str, str]:
    """``config`` (a TrainerConfig) and ``module``'s ``hparams`` as flat text pairs."""
    pairs: dict[str, str] = {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        fields: dict[object, object] = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)
                  if field.name not in _SKIPPED_FIELDS}
        _flatten("config", fields, pairs)
    hparams = getattr(getattr(module, "lightning_module", module), "hparams", None)
    if isinstance(hparams, Mapping):
        _flatten("hparams", hparams, pairs)
    return pairs


def _flatten(prefix: str, values: Mapping[str, object] | Mapping[object, object], pairs: dict[str, str]) -> None:
    for name, value in values.items():
        key = f"{prefix}/{name}"
        if isinstance(value, Mapping):
            _flatten(key, value, pairs)
        else:
            pairs[key] = _text(value)[:MAX_VALUE_CHARACTERS]


def _text(value: object) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return repr(value)
    return value if isinstance(value, str) else repr(value)
