"""Schedulers stepped with a logged metric's value (``ReduceLROnPlateau``), at boundaries.

A monitored :class:`~engine.loops.optim_setup.LRSchedule` is not stepped in the flow (the split's
metrics are not reduced yet there) but by the run at its boundaries, after the metrics of the
boundary and the validation due there are in: ``interval="step"`` at the boundary after each unit
of step work (a batch, or a TBPTT split), ``interval="epoch"`` at each epoch end; each at every
``frequency``-th such point of the run. Whether a point is due is a pure function of the
completed counts, which resume restores, and the scheduler's own state travels in the checkpoint
with every other scheduler's: a resumed run steps it at the same points with the same values.
"""

from __future__ import annotations

from typing import Callable, Mapping, Protocol, Sequence, cast

from engine.errors import ModuleContractError
from engine.loops.optim_setup import LRSchedule

# How the value is agreed between the processes of a distributed run (their mean), or kept as is.
AgreeValues = Callable[[list[float]], list[float]]


class SteppedWithMetric(Protocol):
    """A scheduler whose ``step`` takes the monitored value (``ReduceLROnPlateau.step(metrics)``)."""

    def step(self, metrics: float) -> None: ...


def _unchanged(values: list[float]) -> list[float]:
    return values


class MonitoredSchedules:
    """The monitored schedules of one fit (none under manual optimization: the step steps its own)."""

    def __init__(self, schedules: Sequence[LRSchedule], agree: AgreeValues = _unchanged) -> None:
        self._by_interval = {interval: [s for s in schedules if s.monitored and s.interval == interval]
                             for interval in ("step", "epoch")}
        self._agree = agree

    def after_unit(self, units_completed: int, metrics: Mapping[str, float]) -> None:
        """At the boundary after a unit of step work, once its metrics and validation are in."""
        self._step_due(self._by_interval["step"], units_completed, metrics,
                       lambda: f"at the boundary after {units_completed} units of step work (batches, or TBPTT splits)")

    def after_epoch(self, epochs_completed: int, metrics: Mapping[str, float]) -> None:
        """At an epoch's end, once its aggregates and validation are in."""
        self._step_due(self._by_interval["epoch"], epochs_completed, metrics,
                       lambda: f"at the end of epoch {epochs_completed - 1}")

    def _step_due(self, schedules: list[LRSchedule], completed: int, metrics: Mapping[str, float],
                  where: Callable[[], str]) -> None:
        due = [schedule for schedule in schedules if completed % schedule.frequency == 0]
        if not due:
            return
        values = self._agree([_value_of(schedule, metrics, where) for schedule in due])
        for schedule, value in zip(due, values, strict=True):
            cast(SteppedWithMetric, schedule.scheduler).step(value)


def _value_of(schedule: LRSchedule, metrics: Mapping[str, float], where: Callable[[], str]) -> float:
    monitor = schedule.monitor
    assert monitor is not None
    if monitor not in metrics:
        raise ModuleContractError(
            f"{type(schedule.scheduler).__name__} monitor={monitor!r}: no such metric {where()}, where it is stepped; "
            f"the run has {sorted(metrics)} (log it with self.log({monitor!r}, ...) or return it from validation_step)")
    return metrics[monitor]
