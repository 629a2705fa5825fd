"""Callbacks: a few hooks with no-op defaults, each given a read-only view of the run."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from progress import Cursor


@dataclasses.dataclass
class RunStatus:
    """Where the run is, as the run updates it at each boundary (read through :class:`RunView`)."""

    cursor: Cursor | None = None
    losses: list[float] = dataclasses.field(default_factory=list)
    optimizer_steps: int = 0
    epochs_completed: int = 0
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


class RunView:
    """What a callback may see of the run, and the one thing it may do: ask to stop."""

    def __init__(self, status: RunStatus, request_stop: Callable[[str], None]) -> None:
        self._status = status
        self._request_stop = request_stop

    @property
    def cursor(self) -> Cursor | None:
        """Position of the last completed split (None before the first)."""
        return self._status.cursor

    @property
    def losses(self) -> list[float]:
        """Losses of the last split, one per optimizer."""
        return list(self._status.losses)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps so far, all optimizers together."""
        return self._status.optimizer_steps

    @property
    def epochs_completed(self) -> int:
        """Epochs completed so far (resumed runs included)."""
        return self._status.epochs_completed

    @property
    def metrics(self) -> dict[str, float]:
        """The newest value of every logged metric (``val_loss`` and friends after a
        validation; a training name's epoch aggregate after its epoch ended)."""
        return dict(self._status.metrics)

    def request_stop(self, reason: str = "stop requested by a callback") -> None:
        """Stop at the end of the current split (a checkpoint is written if enabled)."""
        self._request_stop(reason)


class Callback:
    """Subclass and override the hooks you need. State returned by ``state_dict()`` is saved
    in checkpoints and given back to ``load_state_dict()`` on resume."""

    def on_fit_start(self, view: RunView) -> None:
        """Before the first split of this process (also after a resume)."""

    def on_split_end(self, view: RunView) -> None:
        """After each completed split (each batch without TBPTT)."""

    def on_validation_end(self, view: RunView) -> None:
        """After each validation pass (``view.metrics`` holds its results)."""

    def on_epoch_end(self, view: RunView) -> None:
        """After each completed epoch."""

    def on_fit_end(self, view: RunView) -> None:
        """When fit returns normally."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
