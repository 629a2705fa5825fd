"""The LightningModule's hooks and checkpoint state at the engine's boundaries, as one engine
callback (its state is saved in every checkpoint, pickle-free):

- ``on_fit_start``: ``on_fit_start``, ``on_train_start`` (again after a resume, as Lightning does
  on a new ``fit``); the optimizer-step hooks (``global_step``, ``on_before_optimizer_step``);
- ``on_split_end``: ``on_train_batch_end`` after the last split of a batch;
- ``on_validation_end``: ``on_validation_epoch_end``, ``on_validation_end`` (the bridge calls
  ``on_validation_start``, ``on_validation_epoch_start`` and the batch hooks in the pass);
- ``on_epoch_end``: ``on_train_epoch_end`` (after the epoch's validation, as in Lightning 2.x);
- ``state_dict``: the hyperparameters, ``on_save_checkpoint``'s additions, the datamodule's state;
  ``load_state_dict`` gives them back through ``on_load_checkpoint`` / ``load_state_dict``.
"""

from __future__ import annotations

from typing import Any


from engine.callbacks import Callback, RunView
from engine.checkpoint.format.state_keys import HYPERPARAMETERS
from engine.lightning._bridge import LightningBridge
from engine.lightning._logging import VALIDATION
from engine.lightning._packages import overrides
from engine.lightning._plain import plain_data
from engine.lightning._trainer_view import TrainerView

CHECKPOINT_ADDITIONS, DATAMODULE = "on_save_checkpoint", "datamodule"


class LightningHooks(Callback):
    """Calls the LightningModule's hooks at the engine's boundaries (see the module docstring)."""

    def __init__(self, bridge: LightningBridge, trainer_view: TrainerView, datamodule: Any = None) -> None:
        self._bridge = bridge
        self._model: Any = bridge.lightning_module
        self._trainer_view = trainer_view
        self._datamodule = datamodule
        self._handles: list[Any] = []

    def on_fit_start(self, view: RunView) -> None:
        progress = self._bridge.progress
        self._trainer_view.view = view
        progress.global_step, progress.current_epoch = view.optimizer_steps, view.epochs_completed
        self._watch_optimizer_steps()
        self._model.on_fit_start()
        self._model.on_train_start()

    def _watch_optimizer_steps(self) -> None:
        for optimizer in self._bridge._engine_optimizers:
            if overrides(self._model, "on_before_optimizer_step"):
                self._handles.append(optimizer.register_step_pre_hook(
                    lambda stepped, args, kwargs: self._model.on_before_optimizer_step(stepped)))
            self._handles.append(optimizer.register_step_post_hook(self._count_step))

    def _count_step(self, optimizer: object, args: object, kwargs: object) -> None:
        self._bridge.progress.global_step += 1

    def close(self) -> None:
        """Remove the optimizer-step hooks (the optimizers may outlive this fit)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def on_split_end(self, view: RunView) -> None:
        progress = self._bridge.progress
        if progress.batch_end is not None:
            outputs, batch, batch_idx = progress.batch_end
            progress.batch_end = None
            self._model.on_train_batch_end(outputs, batch, batch_idx)
        self._stop_if_asked(view)

    def on_validation_end(self, view: RunView) -> None:
        self._bridge.end_evaluation(VALIDATION)
        self._stop_if_asked(view)

    def on_epoch_end(self, view: RunView) -> None:
        self._model.on_train_epoch_end()
        progress = self._bridge.progress
        progress.current_epoch, progress.epoch_started = view.epochs_completed, False
        self._stop_if_asked(view)

    def _stop_if_asked(self, view: RunView) -> None:
        if self._bridge.progress.should_stop:
            self._bridge.progress.should_stop = False
            view.request_stop("the LightningModule set trainer.should_stop")

    def state_dict(self) -> dict[str, Any]:
        model = self._model
        additions: dict[str, Any] = {}
        model.on_save_checkpoint(additions)
        state = {
            HYPERPARAMETERS: hyperparameters_of(model),
            CHECKPOINT_ADDITIONS: plain_data(additions, f"{type(model).__name__}.on_save_checkpoint's checkpoint"),
        }
        if self._datamodule is not None:
            state[DATAMODULE] = plain_data(self._datamodule.state_dict(),
                                           f"{type(self._datamodule).__name__}.state_dict()")
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        checkpoint = dict(state[CHECKPOINT_ADDITIONS])
        checkpoint["hyper_parameters"] = state[HYPERPARAMETERS]
        self._model.on_load_checkpoint(checkpoint)
        if self._datamodule is not None and DATAMODULE in state:
            self._datamodule.load_state_dict(state[DATAMODULE])


def hyperparameters_of(model: Any) -> dict[str, Any]:
    """What ``save_hyperparameters()`` recorded, as plain data (refused, naming the entry, otherwise)."""
    hparams = getattr(model, "hparams", None)
    return plain_data(dict(hparams) if hparams else {}, f"{type(model).__name__}.hparams", tensors=False)
