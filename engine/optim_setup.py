"""Read what ``Module.configure_optimizers`` returned into optimizers and LR schedules."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Protocol

import torch

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
    """

    scheduler: Scheduler
    interval: Literal["step", "epoch"] = "epoch"

    def __post_init__(self) -> None:
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ModuleContractError(
                "ReduceLROnPlateau needs a metric in step(metric); the engine cannot step it. "
                "Step it yourself (for example in Callback.on_epoch_end) and leave it out of configure_optimizers"
            )
        if self.interval not in ("step", "epoch"):
            raise ModuleContractError(f"LRSchedule.interval: expected 'step' or 'epoch', got {self.interval!r}")
        for method in ("step", "state_dict", "load_state_dict"):
            if not callable(getattr(self.scheduler, method, None)):
                raise ModuleContractError(
                    f"LRSchedule.scheduler: {type(self.scheduler).__name__} has no {method}() method"
                )


@dataclasses.dataclass
class OptimizerSetup:
    optimizers: list[torch.optim.Optimizer]
    schedules: list[LRSchedule]


def read_optimizer_setup(returned: object) -> OptimizerSetup:
    """Normalize ``configure_optimizers()``'s result; raise ModuleContractError if unusable."""
    schedules_in: object = []
    if isinstance(returned, dict):
        unknown = set(returned) - {"optimizers", "schedulers"}
        if unknown or "optimizers" not in returned:
            raise ModuleContractError(
                "configure_optimizers returned a dict; expected keys 'optimizers' and optionally "
                f"'schedulers', got {sorted(returned)}"
            )
        optimizers_in = returned["optimizers"]
        schedules_in = returned.get("schedulers", [])
    else:
        optimizers_in = returned
    optimizers = _as_list(optimizers_in)
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise ModuleContractError(
            "configure_optimizers must return a torch.optim.Optimizer, a non-empty list of them, "
            f"or a dict with 'optimizers'; got {returned!r}"
        )
    schedules = [s if isinstance(s, LRSchedule) else LRSchedule(s) for s in _as_list(schedules_in)]
    for schedule in schedules:
        owner = getattr(schedule.scheduler, "optimizer", None)
        if not any(owner is o for o in optimizers):
            raise ModuleContractError(
                f"scheduler {type(schedule.scheduler).__name__} does not belong to any returned optimizer"
            )
    return OptimizerSetup(optimizers, schedules)


def _as_list(value: object) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]
