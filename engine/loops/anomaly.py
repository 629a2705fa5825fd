"""Numerical anomalies, caught before they reach ``optimizer.step`` (``TrainerConfig.anomaly``).

:class:`AnomalyWatch` checks each split's loss before its backward (non-finite; above
``factor`` times the median of the last ``window`` split losses) and, through a step pre-hook,
the gradients before each optimizer step (non-finite; under ``"16-mixed"`` the gradient scaler
skips such a step itself, which is no anomaly). It raises :class:`AnomalyDetected`, which the
run catches to roll back (engine.run.rollback). :class:`AnomalyHistory` holds the rollbacks of
the run (in its progress) and tells the epoch loop which batches to skip.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable

import torch

from engine.config import Rollback
from engine.loops.context import Position
from progress import Anomaly, Cursor


# Agrees a split's anomaly across the ranks of a torchrun job: (code, value) in, the agreed
# (code, value) out; code 0: none (engine.distributed.agreement.agree_on_anomaly).
Agreement = Callable[[int, float], "tuple[int, float]"]
LOSS_KINDS = ("", "non-finite loss", "loss spike")  # by code


class AnomalyDetected(Exception):
    """An anomaly met inside the loops, before any optimizer step used it; the run rolls back.
    Not an EngineError: it never leaves ``fit`` (an :class:`engine.AnomalyError` does)."""

    def __init__(self, kind: str, value: float, split: Cursor) -> None:
        super().__init__(f"{kind} {value} at {split}")
        self.kind = kind
        self.value = value
        self.split = split


class AnomalyWatch:
    """The checks of :class:`engine.Rollback` (see the module docstring). Its window of recent
    split losses travels in the flow's state, so a resumed run judges spikes the same way."""

    def __init__(self, policy: Rollback, position: Position, optimizers: list[torch.optim.Optimizer],
                 check_gradients: bool, agree: Agreement | None = None) -> None:
        self._agree = agree
        self._factor = policy.factor
        self._window = policy.window
        self._position = position
        self.recent: list[float] = []
        self._handles = [optimizer.register_step_pre_hook(self._before_step)
                         for optimizer in optimizers] if check_gradients else []

    def check_loss(self, loss: torch.Tensor, optimizer_index: int) -> None:
        """Raise AnomalyDetected for a non-finite loss, or (the first optimizer's) a spike; under
        torchrun, on every rank when any rank met one (before backward, whose gradient sync
        would otherwise wait for a rank that stopped)."""
        value = float(loss.detach().float().item())
        code = 1 if not math.isfinite(value) else 2 if optimizer_index == 0 and self._is_spike(value) else 0
        if self._agree is not None:
            code, value = self._agree(code, value)
        if code:
            raise AnomalyDetected(LOSS_KINDS[code], value, self._cursor(optimizer_index))
        if optimizer_index == 0:
            self.recent = [*self.recent, value][-self._window:]

    def _is_spike(self, value: float) -> bool:
        """Only once ``window`` losses are known: their median is the reference."""
        return (self._factor is not None and len(self.recent) == self._window
                and value > self._factor * statistics.median(self.recent))

    def _before_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        gradients = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not gradients:
            return
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in gradients])))
        if not math.isfinite(norm):
            raise AnomalyDetected("non-finite gradients", norm, self._cursor(0))

    def _cursor(self, optimizer_index: int) -> Cursor:
        position = self._position
        return Cursor(position.epoch, position.batch, position.split, optimizer_index)

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent = [float(value) for value in state.get("recent", [])][-self._window:]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class NoAnomalyWatch:
    """Without ``TrainerConfig.anomaly``: no check, no cost."""

    def check_loss(self, loss: torch.Tensor, optimizer_index: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def make_anomaly_watch(policy: Rollback | None, position: Position, optimizers: list[torch.optim.Optimizer],
                       precision: str, agree: Agreement | None = None) -> AnomalyWatch | NoAnomalyWatch:
    """The watch ``TrainerConfig.anomaly`` asks for; under "16-mixed" the scaler judges
    gradients. ``agree``: a torchrun job's agreement on each loss check (gradients, synced by
    DDP before the step, are the same on every rank and need none)."""
    if policy is None:
        return NoAnomalyWatch()
    return AnomalyWatch(policy, position, optimizers, check_gradients=precision != "16-mixed", agree=agree)


class AnomalyHistory:
    """The run's rollbacks (saved in its progress) and the batches they skip."""

    def __init__(self) -> None:
        self.records: list[Anomaly] = []
        self._skipped: frozenset[tuple[int, int]] = frozenset()

    def load(self, records: list[Anomaly]) -> None:
        self.records = list(records)
        self._skipped = frozenset(pair for record in self.records for pair in record.skipped)

    def add(self, record: Anomaly) -> None:
        self.load([*self.records, record])

    def skips(self, epoch: int, batch: int) -> bool:
        """Whether batch ``batch`` of epoch ``epoch`` is skipped (never trained)."""
        return (epoch, batch) in self._skipped
