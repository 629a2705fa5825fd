"""What a resumed checkpoint overrides of what ``configure_optimizers`` built.

Resuming loads the optimizers' and schedulers' state dicts, hyper-parameters included: a learning
rate changed in ``configure_optimizers`` since the checkpoint was written is replaced by the
checkpoint's. :func:`built_settings` notes the settings as built (before the restore) and
:func:`overridden_settings` names those the restore replaced, so the run can say so.

Values that the training itself moves are not settings and are never reported: every
scheduler's progress (``last_epoch``, ``_last_lr``, ...), the ``lr`` of a param group that a
scheduler drives (its ``initial_lr`` is the setting), and the momentum a cycling scheduler moves.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch

from engine.loops.optim_setup import OptimizerSetup

# Scheduler state that counts progress (torch.optim.lr_scheduler), at any nesting level.
SCHEDULER_PROGRESS_KEYS = frozenset({"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step",
                                     "_is_initial", "best", "num_bad_epochs", "cooldown_counter", "T_cur", "T_i"})
SCHEDULED_GROUP_KEYS = frozenset({"lr"})
CYCLED_MOMENTUM_KEYS = frozenset({"momentum", "betas"})


@dataclasses.dataclass
class BuiltSettings:
    """The hyper-parameters as built: per optimizer, per param group; per scheduler, flattened."""

    optimizers: list[list[dict[str, Any]]]
    schedulers: list[dict[str, Any]]


def built_settings(setup: OptimizerSetup) -> BuiltSettings:
    """Note the settings of ``setup`` (call before loading a checkpoint into it)."""
    return BuiltSettings(
        optimizers=[[_group_settings(group) for group in optimizer.param_groups] for optimizer in setup.optimizers],
        schedulers=[dict(_flatten(schedule.scheduler.state_dict(), "")) for schedule in setup.schedules],
    )


def overridden_settings(built: BuiltSettings, setup: OptimizerSetup) -> list[str]:
    """Each setting the restore changed, as ``"optimizer 0 group 0 lr: checkpoint 0.003,
    configure_optimizers 0.001"``; empty when the checkpoint agrees with what was built."""
    differences = []
    for index, (groups, optimizer) in enumerate(zip(built.optimizers, setup.optimizers)):
        driven = _scheduler_driven_keys(optimizer, setup)
        for group_index, (fresh, group) in enumerate(zip(groups, optimizer.param_groups)):
            differences += [_describe(f"optimizer {index} group {group_index} {key}", group[key], value)
                            for key, value in fresh.items()
                            if key not in driven and key in group and not _same(group[key], value)]
    for index, (fresh, schedule) in enumerate(zip(built.schedulers, setup.schedules)):
        restored = dict(_flatten(schedule.scheduler.state_dict(), ""))
        differences += [_describe(f"scheduler {index} {path}", restored[path], value)
                        for path, value in fresh.items() if path in restored and not _same(restored[path], value)]
    return differences


def _group_settings(group: dict[str, Any]) -> dict[str, Any]:
    return {key: _copy(value) for key, value in group.items() if key != "params"}


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _scheduler_driven_keys(optimizer: torch.optim.Optimizer, setup: OptimizerSetup) -> frozenset[str]:
    driven: set[str] = set()
    for schedule in setup.schedules:
        if getattr(schedule.scheduler, "optimizer", None) is optimizer:
            driven |= SCHEDULED_GROUP_KEYS
            if getattr(schedule.scheduler, "cycle_momentum", False):
                driven |= CYCLED_MOMENTUM_KEYS
    return frozenset(driven)


def _flatten(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(path, leaf) pairs of a scheduler's state dict, without its progress entries."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in SCHEDULER_PROGRESS_KEYS:
                yield from _flatten(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)) and any(isinstance(item, (dict, list, tuple)) for item in value):
        for index, item in enumerate(value):
            yield from _flatten(item, f"{path}[{index}]")
    else:
        yield path, _copy(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _describe(name: str, checkpoint: Any, built: Any) -> str:
    return f"{name}: checkpoint {_show(checkpoint)}, configure_optimizers {_show(built)}"


def _show(value: Any) -> str:
    return repr(value.tolist() if isinstance(value, torch.Tensor) else value)
