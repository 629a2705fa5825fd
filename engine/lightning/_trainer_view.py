"""What a LightningModule reads through ``self.trainer`` while the adapter runs it."""

from __future__ import annotations

from typing import Any

import torch

from engine.callbacks import RunView
from engine.config import TrainerConfig
from engine.lightning._bridge import LightningBridge


class TrainerView:
    """``self.trainer`` for a LightningModule run by :class:`engine.lightning.Trainer`:
    ``current_epoch``, ``global_step``, ``max_epochs``, ``max_steps``, ``is_global_zero``,
    ``world_size``, ``global_rank``, ``local_rank``, ``callback_metrics``, ``logged_metrics``,
    ``optimizers`` and ``should_stop`` (setting it stops the run at the next boundary, with a
    checkpoint). The module keeps it after ``fit``, as it keeps Lightning's trainer."""

    logger = None
    loggers: list[Any] = []
    sanity_checking = False
    barebones = False
    _results = None  # self.log outside a step (after fit) is Lightning's own "not registered" error

    def __init__(self, bridge: LightningBridge, config: TrainerConfig, datamodule: Any = None) -> None:
        self._bridge = bridge
        self._config = config
        self.datamodule = datamodule
        self.view: RunView | None = None

    @property
    def current_epoch(self) -> int:
        return self._bridge.progress.current_epoch

    @property
    def global_step(self) -> int:
        return self._bridge.progress.global_step

    @property
    def max_epochs(self) -> int | None:
        return self._config.max_epochs

    @property
    def max_steps(self) -> int:
        return -1 if self._config.max_steps is None else self._config.max_steps

    @property
    def world_size(self) -> int:
        distributed = torch.distributed
        return distributed.get_world_size() if distributed.is_available() and distributed.is_initialized() else 1

    @property
    def global_rank(self) -> int:
        distributed = torch.distributed
        return distributed.get_rank() if distributed.is_available() and distributed.is_initialized() else 0

    @property
    def local_rank(self) -> int:
        return self.global_rank

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """The newest value of every logged name (as of the last split, validation or epoch end)."""
        metrics = {} if self.view is None else self.view.metrics
        return {name: torch.tensor(value) for name, value in metrics.items()}

    @property
    def logged_metrics(self) -> dict[str, torch.Tensor]:
        return self.callback_metrics

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self._bridge._engine_optimizers)

    @property
    def should_stop(self) -> bool:
        return self._bridge.progress.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._bridge.progress.should_stop = bool(value)
