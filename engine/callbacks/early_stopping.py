"""Early stopping as a built-in callback whose state is checkpointed."""

from __future__ import annotations

import math
from typing import Any, Literal

from engine.callbacks import Callback, RunView
from engine.errors import ConfigError


class EarlyStopping(Callback):
    """Stop when a monitored metric has not improved for ``patience`` checks in a row.

    Args:
        monitor: a metric name as in ``RunView.metrics`` (``val_loss``, or anything logged
            with ``Module.log``).
        mode: ``"min"`` (lower is better) or ``"max"``.
        patience: how many checks without improvement end the run.
        min_delta: an improvement must beat the best value by more than this.
        check_on: ``"validation"`` checks after each validation pass; ``"epoch"`` after each
            epoch (for a training metric's epoch aggregate).

    Its best value and count are saved in every checkpoint, so a run killed while counting
    resumes the count and stops at the same step as a run that was never interrupted::

        trainer = engine.Trainer(config, callbacks=[engine.EarlyStopping("val_loss", patience=3)])
    """

    def __init__(self, monitor: str = "val_loss", mode: Literal["min", "max"] = "min", patience: int = 3,
                 min_delta: float = 0.0, check_on: Literal["validation", "epoch"] = "validation") -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ConfigError(f"EarlyStopping.monitor: expected a metric name, got {monitor!r}")
        if mode not in ("min", "max"):
            raise ConfigError(f"EarlyStopping.mode: expected 'min' or 'max', got {mode!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ConfigError(f"EarlyStopping.patience: expected a positive int, got {patience!r}")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or not min_delta >= 0 or math.isinf(min_delta):
            raise ConfigError(f"EarlyStopping.min_delta: expected a finite number >= 0, got {min_delta!r}")
        if check_on not in ("validation", "epoch"):
            raise ConfigError(f"EarlyStopping.check_on: expected 'validation' or 'epoch', got {check_on!r}")
        self.monitor, self.mode, self.patience = monitor, mode, patience
        self.min_delta, self.check_on = float(min_delta), check_on
        self.best: float | None = None
        self.checks_without_improvement = 0

    def on_validation_end(self, view: RunView) -> None:
        if self.check_on == "validation":
            self._check(view)

    def on_epoch_end(self, view: RunView) -> None:
        if self.check_on == "epoch":
            self._check(view)

    def _check(self, view: RunView) -> None:
        metrics = view.metrics
        if self.monitor not in metrics:
            raise ConfigError(f"EarlyStopping: no metric {self.monitor!r} to monitor; the run has {sorted(metrics)}")
        value = metrics[self.monitor]
        if self._improves(value):
            self.best, self.checks_without_improvement = value, 0
            return
        self.checks_without_improvement += 1
        if self.checks_without_improvement >= self.patience:
            view.request_stop(f"early stopping: {self.monitor} did not improve on {self.best} "
                              f"for {self.patience} check(s)")

    def _improves(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "checks_without_improvement": self.checks_without_improvement}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        best = state["best"]
        self.best = None if best is None else float(best)
        self.checks_without_improvement = int(state["checks_without_improvement"])
