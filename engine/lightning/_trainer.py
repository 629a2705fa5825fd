"""``engine.lightning.Trainer``: run an unmodified LightningModule on engine.Trainer."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterable, Iterator, NoReturn, Sequence

import torch

from engine.config import TrainerConfig
from engine.errors import ConfigError, warn as warn_user
from engine.lightning._bridge import LightningBridge
from engine.lightning._callbacks import Translated, translate_callbacks
from engine.lightning._hooks import LightningHooks, hyperparameters_of
from engine.lightning._loggers import translate_loggers
from engine.lightning._logging import TEST, VALIDATION
from engine.lightning._packages import overrides, require_datamodule, require_lightning_module
from engine.lightning._refusals import (UNSUPPORTED_EVALUATION_HOOKS, refuse_together, refuse_unsupported_config,
                                        refuse_unsupported_hooks)
from engine.lightning._trainer_view import TrainerView
from engine.loops.device import move_to_device
from engine.loops.logged import MetricLogger, reduce_recordings
from engine.result import FitResult
from engine.trainer import Trainer as EngineTrainer
from engine.unknown_keywords import LIGHTNING_FIT, from_lightning, refuse_keywords, refuse_unknown_keywords, trainer_hints

# The LightningModule methods that reach Lightning's trainer, answered by the bridge while it runs.
_BRIDGED_METHODS = {"log": "log", "log_dict": "log_dict", "optimizers": "lightning_optimizers",
                    "lr_schedulers": "lightning_lr_schedulers", "manual_backward": "lightning_manual_backward",
                    "clip_gradients": "lightning_clip_gradients"}


class Trainer:
    """Trains a ``LightningModule`` (``pytorch_lightning`` or ``lightning.pytorch``) unmodified, with
    every guarantee of :class:`engine.Trainer`: exact resume at the interrupted split, preemption,
    torchrun, isolated validation, best checkpoints, metrics.jsonl written once.

    Example::

        from engine.lightning import Trainer
        from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint

        trainer = Trainer(engine.TrainerConfig(max_epochs=5, run_dir="runs/ae"),
                          callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=2),
                                     EarlyStopping(monitor="val_loss", patience=3)])
        trainer.fit(LitAutoEncoder(), train_loader, val_loader)   # run it again: it resumes

    Args:
        config: the engine's TrainerConfig (Lightning's Trainer arguments are refused, naming
            the field to use; see docs/lightning.md).
        callbacks: Lightning's ``ModelCheckpoint`` and ``EarlyStopping`` (translated to the
            engine's), and engine.Callback objects. Any other Lightning callback is refused.
        logger: Lightning's ``TensorBoardLogger``, ``CSVLogger`` or ``MLFlowLogger`` (or a list),
            each translated to the engine's (added to ``config.loggers``); any other is refused.
    """

    @refuse_unknown_keywords("engine.lightning.Trainer",
                             trainer_hints(field.name for field in dataclasses.fields(TrainerConfig)))
    def __init__(self, config: TrainerConfig | None = None, callbacks: Sequence[object] = (),
                 logger: object = None) -> None:
        self.config = config if config is not None else TrainerConfig()
        if not isinstance(self.config, TrainerConfig):
            raise ConfigError(f"engine.lightning.Trainer: config must be an engine.TrainerConfig, got "
                              f"{type(config).__name__}")
        self._callbacks = list(callbacks)
        translate_callbacks(self._callbacks, self.config)  # refused here already, as Lightning's Trainer does
        self._loggers = translate_loggers(logger)
        self._trainer_view: TrainerView | None = None  # the last fit's, which the module keeps after it

    @property
    def global_step(self) -> int:
        """Optimizer steps of the last ``fit`` (all optimizers together), as Lightning counts them; 0 before."""
        return 0 if self._trainer_view is None else self._trainer_view.global_step

    @property
    def current_epoch(self) -> int:
        """Epochs completed by the last ``fit``, as Lightning's ``current_epoch`` after it; 0 before."""
        return 0 if self._trainer_view is None else self._trainer_view.current_epoch

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """The newest value of every name logged in the last ``fit``."""
        return {} if self._trainer_view is None else self._trainer_view.callback_metrics

    def predict(self, *args: object, **kwargs: object) -> NoReturn:
        """Not supported: prediction needs none of the engine's guarantees; see the error."""
        raise ConfigError("engine.lightning.Trainer.predict: not supported (prediction needs no checkpoints); run "
                          "predict_step yourself: model.eval(); with torch.no_grad(): outputs = "
                          "[model.predict_step(batch, batch_idx) for batch_idx, batch in enumerate(loader)]")

    def fit(self, model: torch.nn.Module, train_dataloaders: Iterable[Any] | None = None,
            val_dataloaders: Iterable[Any] | None = None, datamodule: Any = None, resume: str = "auto",
            **unknown: NoReturn) -> FitResult:
        """Train ``model`` as ``pytorch_lightning.Trainer.fit`` would, resuming from ``run_dir``.

        Args:
            model: a LightningModule.
            train_dataloaders, val_dataloaders: the loaders; or ``datamodule``'s (or the model's
                own ``train_dataloader()`` / ``val_dataloader()``) when not given.
            datamodule: a LightningDataModule (``prepare_data``, ``setup("fit")``, its loaders;
                its ``state_dict()`` is saved in every checkpoint).
            resume: as in :meth:`engine.Trainer.fit` (Lightning's ``ckpt_path`` is refused).
        """
        refuse_keywords("fit", unknown, Trainer.fit, from_lightning({"ckpt_path": LIGHTNING_FIT["ckpt_path"]}))
        return self._fit(model, train_dataloaders, val_dataloaders, datamodule, resume)

    def _fit(self, model: Any, train_dataloaders: Iterable[Any] | None, val_dataloaders: Iterable[Any] | None,
             datamodule: Any, resume: str) -> FitResult:
        require_lightning_module(model)
        translated: list[Translated] = []
        bridges: list[LightningBridge] = []
        refuse_together([  # every refusal the module and its settings earn, in one message, before anything runs
            lambda: refuse_unsupported_hooks(model),
            lambda: refuse_unsupported_config(self.config, model),
            lambda: hyperparameters_of(model),  # not plain data
            lambda: require_datamodule(datamodule),
            lambda: translated.append(translate_callbacks(_with_model_callbacks(model, self._callbacks), self.config)),
            lambda: bridges.append(LightningBridge(model)),  # a TBPTT step without hiddens
        ])
        engine_config = dataclasses.replace(self.config, checkpoint=translated[0].checkpoint,
                                            loggers=[*self.config.loggers, *self._loggers])
        bridge = bridges[0]
        trainer_view = TrainerView(bridge, engine_config, datamodule)
        self._trainer_view = trainer_view
        hooks = LightningHooks(bridge, trainer_view, datamodule)
        with _attached(bridge, trainer_view, keep_trainer=True):
            stages = [owner for owner in (datamodule, model) if owner is not None]
            for owner in stages:
                owner.prepare_data()
            for owner in stages:
                owner.setup("fit")
            train, val = _fit_data(model, train_dataloaders, val_dataloaders, datamodule)
            try:
                result = EngineTrainer(engine_config, [hooks, *translated[0].callbacks]).fit(
                    bridge, train, val, resume=resume)
            finally:
                hooks.close()
            if not result.preempted:
                model.on_train_end()
                model.on_fit_end()
            for owner in stages:
                owner.teardown("fit")
        return result

    def validate(self, model: torch.nn.Module, dataloaders: Iterable[Any] | None = None,
                 datamodule: Any = None) -> list[dict[str, float]]:
        """One pass of ``validation_step`` over the data; returns ``[{name: value}]`` as Lightning does."""
        return self._evaluate(model, VALIDATION, dataloaders, datamodule)

    def test(self, model: torch.nn.Module, dataloaders: Iterable[Any] | None = None,
             datamodule: Any = None) -> list[dict[str, float]]:
        """One pass of ``test_step`` over the data; returns ``[{name: value}]`` as Lightning does."""
        return self._evaluate(model, TEST, dataloaders, datamodule)

    def _evaluate(self, model: Any, hook: str, dataloaders: Iterable[Any] | None,
                  datamodule: Any) -> list[dict[str, float]]:
        require_lightning_module(model)
        refuse_together([lambda: refuse_unsupported_hooks(model, UNSUPPORTED_EVALUATION_HOOKS[hook]),
                         lambda: require_datamodule(datamodule)])
        if datamodule is not None:
            datamodule.prepare_data()
            datamodule.setup("validate" if hook == VALIDATION else "test")
        method = "val_dataloader" if hook == VALIDATION else "test_dataloader"
        data = dataloaders if dataloaders is not None else _loader(model, datamodule, method)
        if data is None:
            raise ConfigError(f"{hook.replace('_step', '')}: no data; pass dataloaders= or a datamodule with {method}()")
        bridge = LightningBridge(model)
        if self._trainer_view is not None:  # the module still sees the last fit's epoch and step
            bridge.progress.current_epoch, bridge.progress.global_step = self.current_epoch, self.global_step
        logger = bridge._engine_logger = MetricLogger()
        device = next(model.parameters()).device
        with _attached(bridge, TrainerView(bridge, self.config, datamodule)), torch.no_grad():
            was_training = model.training
            model.eval()
            logger.begin_evaluation()
            try:
                for batch in data:
                    bridge.evaluation_step(hook, move_to_device(batch, device))
                bridge.end_evaluation(hook)
            finally:
                values = reduce_recordings([logger.end_evaluation()])
                model.train(was_training)
        return [values]


def _fit_data(model: Any, train: Iterable[Any] | None, val: Iterable[Any] | None,
              datamodule: Any) -> tuple[Iterable[Any], Iterable[Any] | None]:
    """The training and validation data: given, or the datamodule's, or the model's own."""
    train = train if train is not None else _loader(model, datamodule, "train_dataloader")
    if train is None:
        raise ConfigError("fit: no training data; pass train_dataloaders=, a datamodule, or define train_dataloader()")
    val = val if val is not None else _loader(model, datamodule, "val_dataloader")
    if val is not None and not overrides(model, "validation_step"):
        # As Lightning does (it warns too): no validation_step, no validation loop.
        warn_user(f"{type(model).__name__} has no validation_step: the validation data is not used")
        return train, None
    return train, val


def _loader(model: Any, datamodule: Any, method: str) -> Any:
    """The datamodule's (else the model's) ``method()`` when the user defined it."""
    for owner in (datamodule, model):
        if owner is not None and overrides(owner, method):
            return getattr(owner, method)()
    return None


def _with_model_callbacks(model: Any, callbacks: list[object]) -> list[object]:
    """The trainer's callbacks with what the module's ``configure_callbacks()`` returns, as
    Lightning's fit attaches them: a returned callback replaces the trainer's of its class (or a
    base class of it)."""
    if not overrides(model, "configure_callbacks"):
        return callbacks
    returned = model.configure_callbacks()
    if not returned:
        return callbacks
    returned = list(returned) if isinstance(returned, Sequence) else [returned]
    replaced = {type(callback) for callback in callbacks
                if any(issubclass(type(new), type(callback)) for new in returned)}
    return [callback for callback in callbacks if type(callback) not in replaced] + returned


@contextlib.contextmanager
def _attached(bridge: LightningBridge, trainer_view: TrainerView, keep_trainer: bool = False) -> Iterator[None]:
    """Point the LightningModule's trainer-facing methods and ``self.trainer`` at the bridge
    for the run, and take them back after it; ``keep_trainer`` leaves ``self.trainer`` (and
    the datamodule's) on the finished run, as Lightning's fit does, so ``global_step`` and
    ``current_epoch`` read its end. Otherwise the module goes back to its previous trainer."""
    model: Any = bridge.lightning_module
    previous = model._trainer, getattr(trainer_view.datamodule, "trainer", None)
    for name, bridged in _BRIDGED_METHODS.items():
        source = bridge.log_sink if name in ("log", "log_dict") else bridge
        setattr(model, name, getattr(source, bridged))
    model.trainer = trainer_view
    if trainer_view.datamodule is not None:
        trainer_view.datamodule.trainer = trainer_view
    try:
        yield
    finally:
        for name in _BRIDGED_METHODS:
            model.__dict__.pop(name, None)
        if not keep_trainer:
            model.trainer = previous[0]
            if trainer_view.datamodule is not None:
                trainer_view.datamodule.trainer = previous[1]
