"""Read what ``Module.configure_optimizers`` returned into optimizers and LR schedules."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Protocol, cast

import torch

from engine.loops.describe import describe_nested
from engine.errors import ModuleContractError


class Scheduler(Protocol):
    """What the engine needs of an LR scheduler (every ``torch.optim.lr_scheduler`` class has it)."""

    optimizer: torch.optim.Optimizer

    def step(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclasses.dataclass
class LRSchedule:
    """An LR scheduler and when the engine steps it (automatic optimization only).

    Args:
        scheduler: any object with ``step()``, ``state_dict()``, ``load_state_dict()`` and an
            ``optimizer`` attribute (all ``torch.optim.lr_scheduler`` classes qualify).
        interval: ``"step"`` steps it after each step of its optimizer; ``"epoch"`` at epoch end.
        monitor: the name of a logged metric (``"val_loss"``, or anything logged with
            ``Module.log``): the scheduler is then stepped with that metric's newest value,
            ``scheduler.step(value)``, as ``ReduceLROnPlateau`` needs (and requires). With
            ``interval="epoch"`` at each epoch end, after the epoch's validation; with
            ``interval="step"`` at the boundary after each unit of step work (a batch, or a
            TBPTT split), after the validation due there.
        frequency: a monitored scheduler is stepped at every ``frequency``-th such point of the
            run (the epochs or units completed are a multiple of it).

    Example::

        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=2)
        return {"optimizers": optimizer, "schedulers": [engine.LRSchedule(plateau, monitor="val_loss")]}
    """

    scheduler: Scheduler
    interval: Literal["step", "epoch"] = "epoch"
    monitor: str | None = None
    frequency: int = 1

    def __post_init__(self) -> None:
        if self.interval not in ("step", "epoch"):
            raise ModuleContractError(f"LRSchedule.interval: expected 'step' or 'epoch', got {self.interval!r}")
        for method in ("step", "state_dict", "load_state_dict"):
            if not callable(getattr(self.scheduler, method, None)):
                raise ModuleContractError(
                    f"LRSchedule.scheduler: {type(self.scheduler).__name__} has no {method}() method"
                )
        self._check_monitor()
        frequency = self.frequency
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise ModuleContractError(f"LRSchedule.frequency: expected a positive int, got {frequency!r}")
        if frequency != 1 and self.monitor is None:
            raise ModuleContractError(
                f"LRSchedule.frequency={frequency} applies to a monitored scheduler only; "
                f"{type(self.scheduler).__name__} is stepped after every step or epoch (leave frequency at 1)")

    def _check_monitor(self) -> None:
        name = type(self.scheduler).__name__
        monitor = self.monitor
        if monitor is None:
            if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise ModuleContractError(
                    "ReduceLROnPlateau is stepped with a metric: name it, engine.LRSchedule(scheduler, "
                    "monitor='val_loss'), or {'scheduler': scheduler, 'monitor': 'val_loss'} in configure_optimizers")
            return
        if not isinstance(monitor, str) or not monitor:
            raise ModuleContractError(f"LRSchedule.monitor: expected the name of a logged metric, got {monitor!r}")
        if _takes_no_metric(self.scheduler):
            raise ModuleContractError(
                f"LRSchedule.monitor={monitor!r}: {name}.step() takes no metric; a monitor is for a scheduler "
                "stepped with one (ReduceLROnPlateau): leave monitor out")

    @property
    def monitored(self) -> bool:
        """Whether the engine steps it with a metric's value (at boundaries, not in the flow)."""
        return self.monitor is not None


def _takes_no_metric(scheduler: object) -> bool:
    """torch's schedulers other than ReduceLROnPlateau step without a metric."""
    lr_scheduler = torch.optim.lr_scheduler
    return (isinstance(scheduler, lr_scheduler.LRScheduler)
            and not isinstance(scheduler, lr_scheduler.ReduceLROnPlateau))


@dataclasses.dataclass
class OptimizerSetup:
    optimizers: list[torch.optim.Optimizer]
    schedules: list[LRSchedule]


def read_optimizer_setup(returned: object) -> OptimizerSetup:
    """Normalize ``configure_optimizers()``'s result; raise ModuleContractError if unusable.

    Accepted: an optimizer; a list or tuple of optimizers; ``{"optimizers": ..., "schedulers":
    [...]}``; and Lightning's forms: ``{"optimizer": opt, "lr_scheduler": sched}`` (a list of
    such dicts for several optimizers) and ``([optimizers], [schedulers])``. A scheduler is a
    bare LR scheduler (stepped per epoch), an :class:`LRSchedule`, or Lightning's
    ``{"scheduler": sched, "interval": "step" | "epoch", "monitor": name, "frequency": n}``.
    """
    optimizers_in, schedules_in = _split_returned(returned)
    optimizers = _as_list(optimizers_in)
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise ModuleContractError(
            "configure_optimizers must return a torch.optim.Optimizer, a non-empty list of them, "
            "a dict with 'optimizers' (and 'schedulers'), or Lightning's {'optimizer': ..., 'lr_scheduler': ...} "
            f"or ([optimizers], [schedulers]); got {_shape_of(returned)}"
        )
    schedules = [_read_schedule(item) for item in _as_list(schedules_in)]
    for schedule in schedules:
        owner = getattr(schedule.scheduler, "optimizer", None)
        if not any(owner is o for o in optimizers):
            raise ModuleContractError(
                f"scheduler {type(schedule.scheduler).__name__} does not belong to any returned optimizer"
            )
    return OptimizerSetup(optimizers, schedules)


def _split_returned(returned: object) -> tuple[object, object]:
    """(optimizers, schedulers) from any accepted form."""
    if isinstance(returned, dict):
        if "optimizer" in returned:
            return _read_lightning_dict(returned)
        unknown = set(returned) - {"optimizers", "schedulers"}
        if unknown or "optimizers" not in returned:
            raise ModuleContractError(
                "configure_optimizers returned a dict; expected keys 'optimizers' and optionally "
                f"'schedulers' (or Lightning's 'optimizer' and 'lr_scheduler'), got {sorted(returned)}"
            )
        return returned["optimizers"], returned.get("schedulers", [])
    if isinstance(returned, tuple) and _is_two_lists(returned):
        return returned[0], returned[1]
    if isinstance(returned, (list, tuple)) and returned and all(isinstance(item, dict) for item in returned):
        pairs = [_read_lightning_dict(item) for item in returned]
        return [optimizer for optimizer, _ in pairs], [s for _, schedules in pairs for s in _as_list(schedules)]
    return returned, []


def _is_two_lists(returned: object) -> bool:
    """Lightning's ``([optimizers], [schedulers])``: a tuple of two lists, the first of optimizers."""
    return (isinstance(returned, tuple) and len(returned) == 2
            and all(isinstance(part, (list, tuple)) for part in returned)
            and bool(returned[0]) and all(isinstance(o, torch.optim.Optimizer) for o in returned[0]))


def _read_lightning_dict(entry: dict[Any, Any]) -> tuple[object, object]:
    """Lightning's ``{"optimizer": o, "lr_scheduler": s, "monitor": m}``; a top-level monitor names
    the metric of a ReduceLROnPlateau that names none itself (as in Lightning)."""
    unknown = set(entry) - {"optimizer", "lr_scheduler", "monitor"}
    if unknown or "optimizer" not in entry:
        raise ModuleContractError(
            f"configure_optimizers returned a Lightning-style dict with keys {sorted(entry)}; expected 'optimizer' "
            "and optionally 'lr_scheduler' and 'monitor' (an optimizer's 'frequency' is not supported)"
        )
    if not isinstance(entry["optimizer"], torch.optim.Optimizer):
        raise ModuleContractError(f"configure_optimizers: 'optimizer' must be a torch.optim.Optimizer, got {_shape_of(entry['optimizer'])}")
    scheduler, monitor = entry.get("lr_scheduler"), entry.get("monitor")
    if scheduler is None and monitor is None:
        return entry["optimizer"], []
    return entry["optimizer"], [_with_monitor(scheduler, monitor)]


def _with_monitor(scheduler: object, monitor: object) -> object:
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    if monitor is None:
        return scheduler
    if isinstance(scheduler, plateau):
        return {"scheduler": scheduler, "monitor": monitor}
    if isinstance(scheduler, dict) and isinstance(scheduler.get("scheduler"), plateau) and scheduler.get("monitor") is None:
        return {**scheduler, "monitor": monitor}
    raise ModuleContractError(
        f"configure_optimizers returned 'monitor': {monitor!r} beside an lr_scheduler that is not a ReduceLROnPlateau "
        f"without a monitor of its own ({_shape_of(scheduler)}), so it would monitor nothing: leave it out")


# Lightning's lr_scheduler config keys; "name" labels the scheduler for Lightning's LR logger and
# changes nothing here.
_SCHEDULE_KEYS = frozenset({"scheduler", "interval", "monitor", "frequency", "strict", "name"})


def _read_schedule(item: object) -> LRSchedule:
    if isinstance(item, LRSchedule):
        return item
    if isinstance(item, dict):
        unknown = set(item) - _SCHEDULE_KEYS
        if unknown or "scheduler" not in item:
            raise ModuleContractError(
                f"an lr_scheduler dict has keys {sorted(item)}; expected 'scheduler' and optionally 'interval' "
                "('step' or 'epoch'), 'monitor', 'frequency', 'strict' (True) and 'name'"
            )
        if item.get("strict", True) is not True:
            raise ModuleContractError(
                f"an lr_scheduler dict has strict={item['strict']!r}: a monitor naming a metric that does not exist "
                "is always an error here (strict=True); name a metric the module logs")
        return LRSchedule(item["scheduler"], item.get("interval", "epoch"), item.get("monitor"),
                          item.get("frequency", 1))
    return LRSchedule(cast(Scheduler, item))  # LRSchedule checks the methods at run time


def _as_list(value: object) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _shape_of(value: object) -> str:
    """What was returned, by type (an optimizer's repr spans many lines): ``list[list[SGD]]``."""
    return describe_nested(value, _leaf_type)


def _leaf_type(value: object) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, type):
        return f"the class {value.__name__} (not an instance: call it, e.g. {value.__name__}(self.parameters(), lr=...))"
    return type(value).__name__
