"""Lightning's loggers (``Trainer(logger=...)``) translated to the engine's: ``TensorBoardLogger``
to :class:`engine.loggers.TensorBoard`, ``CSVLogger`` to :class:`engine.loggers.CSV`,
``MLFlowLogger`` to :class:`engine.loggers.MLflow`, ``WandbLogger`` to :class:`engine.loggers.WandB`,
each with its settings; a list of them; any other logger, or an option the engine's has no
equivalent for, is refused in one line.

Lightning numbers a logger's directory ``version_N``, the next free one at each start; a resumed
run must write where it wrote before, so ``version=None`` is ``version_0``.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from engine.errors import ConfigError
from engine.lightning._packages import derives_from
from engine.loggers import CSV, Logger, MLflow, TensorBoard, WandB

# Options with no engine equivalent: (logger class, attribute, default, remedy).
_REFUSED = (
    ("TensorBoardLogger", "_prefix", "", "metrics keep their names (<stage>/<name>)"),
    ("TensorBoardLogger", "_log_graph", False, "no graph logging"),
    ("TensorBoardLogger", "_sub_dir", None, "give the directory in save_dir/name/version"),
    ("CSVLogger", "_prefix", "", "metrics keep their names"),
    ("MLFlowLogger", "_prefix", "", "metrics keep their names (<stage>/<name>)"),
    ("MLFlowLogger", "_run_id", None, "the engine records the MLflow run of each run_dir itself (mlflow-run.json)"),
    ("MLFlowLogger", "_artifact_location", None, "create the experiment with its artifact location beforehand"),
    ("WandbLogger", "_prefix", "", "metrics keep their names (<stage>/<name>)"),
    ("WandbLogger", "_experiment", None, "the engine creates and resumes the W&B run of each run_dir itself"),
    ("WandbLogger", "_checkpoint_name", None, "log_model=True logs the final weights as the artifact model-<run id>"),
)
# WandbLogger's wandb.init arguments the engine's WandB takes (the others are refused).
_WANDB_INIT = {"name", "project", "dir", "id", "mode", "entity", "tags", "group"}
_WANDB_DEFAULTS = {"resume": "allow", "anonymous": None}


def translate_loggers(logger: object) -> list[Logger]:
    """The engine's loggers for Lightning's ``logger=`` (None or False: none)."""
    if logger is None or logger is False:
        return []
    if logger is True:
        raise ConfigError("engine.lightning.Trainer: logger=True (Lightning's default TensorBoard logger) is not "
                          "supported; pass logger=TensorBoardLogger(save_dir) or TrainerConfig(loggers=[...])")
    loggers = list(logger) if isinstance(logger, (list, tuple)) else [logger]
    refusals = [reason for item in loggers for reason in _refusals(item)]
    if refusals:
        raise ConfigError("; ".join(refusals))
    return [_TRANSLATIONS[_lightning_class(item) or ""](item) for item in loggers]


def _lightning_class(logger: object) -> str | None:
    return next((name for name in _TRANSLATIONS if derives_from(logger, name)), None)


def _refusals(logger: object) -> list[str]:
    name = _lightning_class(logger)
    if name is None:
        return [f"engine.lightning.Trainer: logger {type(logger).__name__} is not supported (TensorBoardLogger, "
                "CSVLogger, MLFlowLogger and WandbLogger are; or give an engine.loggers object in TrainerConfig(loggers=[...]))"]
    refused = [(attribute.lstrip("_"), getattr(logger, attribute), remedy) for owner, attribute, default, remedy
               in _REFUSED if owner == name and getattr(logger, attribute, default) not in (default, None)]
    log_model = getattr(logger, "_log_model", False)
    if name in ("MLFlowLogger", "WandbLogger") and log_model not in (False, True):
        refused.append(("log_model", log_model, "log_model=True logs the weights of the last checkpoint "
                                                        "once, at the end; not every checkpoint"))
    if name == "WandbLogger":
        refused += _wandb_refusals(logger)
    return [f"{name}({option}={value!r}): not supported by engine.lightning ({remedy})"
            for option, value, remedy in refused]


def _wandb_refusals(logger: Any) -> list[tuple[str, object, str]]:
    refused: list[tuple[str, object, str]] = [
        (key, value, "the engine's WandB takes name, project, save_dir, offline/mode, id, entity, tags, group, "
                     "log_model") for key, value in logger._wandb_init.items()
        if key not in _WANDB_INIT and value != _WANDB_DEFAULTS.get(key, object())]
    return refused


def _version_dir(logger: Any) -> str:
    version = logger._version if logger._version is not None else 0
    version = version if isinstance(version, str) else f"version_{version}"
    return os.path.join(os.fspath(logger._root_dir), logger._name or "", version)


def _tensorboard(logger: Any) -> Logger:
    return TensorBoard(_version_dir(logger))


def _csv(logger: Any) -> Logger:
    return CSV(os.path.join(_version_dir(logger), "metrics.csv"))


def _mlflow(logger: Any) -> Logger:
    tags = {str(key): str(value) for key, value in (logger.tags or {}).items()}
    return MLflow(logger._tracking_uri, experiment=logger._experiment_name, run_name=logger._run_name, tags=tags,
                  log_model=bool(logger._log_model))


def _wandb(logger: Any) -> Logger:
    init = logger._wandb_init
    mode = "offline" if logger._offline else init.get("mode")
    return WandB(project=init["project"], name=init.get("name"), mode=mode, dir=init.get("dir"), id=init.get("id"),
                 entity=init.get("entity"), tags=init.get("tags"), group=init.get("group"),
                 log_model=bool(logger._log_model))


_TRANSLATIONS: dict[str, Callable[[Any], Logger]] = {
    "TensorBoardLogger": _tensorboard, "CSVLogger": _csv, "MLFlowLogger": _mlflow, "WandbLogger": _wandb}
