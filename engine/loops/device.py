"""The run's device: resolve ``TrainerConfig.device``, move the module once and every batch.

``"auto"`` is CUDA when available, else the CPU; under torchrun (``LOCAL_RANK`` set) ``"auto"``
and ``"cuda"`` mean ``cuda:LOCAL_RANK``. A CUDA device also becomes torch's current device, so
the CUDA random generator the engine checkpoints (``engine.data.rng``) is the one the run draws from.

Batches are moved by :func:`move_to_device`: tensors inside tuples, lists, dicts and namedtuples
go to the device; every other leaf is left as it is. Copies to CUDA are ``non_blocking`` (they
overlap with compute when the loader pins its memory: ``DataLoader(pin_memory=True)``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from engine.errors import ConfigError
from engine.loops.contracts import BatchRunner, Losses


def resolve_device(spec: str, environ: Mapping[str, str] | None = None) -> torch.device:
    """The device ``TrainerConfig.device`` names on this machine; ConfigError when it is absent."""
    environ = os.environ if environ is None else environ
    local_rank = _local_rank(environ)
    if spec == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        spec = "cuda"
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"TrainerConfig.device: {spec!r} needs CUDA, but torch.cuda.is_available() is False "
                          "on this machine; use 'auto' or 'cpu'")
    index = local_rank if spec == "cuda" else int(spec.partition(":")[2])
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(f"TrainerConfig.device: {spec!r} resolves to cuda:{index} but this machine has "
                          f"{count} CUDA device(s)")
    return torch.device("cuda", index)


def _local_rank(environ: Mapping[str, str]) -> int:
    value = environ.get("LOCAL_RANK")
    if value is None:
        return 0
    if not value.isdigit():
        raise ConfigError(f"environment variable LOCAL_RANK: expected a non-negative int, got {value!r}")
    return int(value)


def prepare_device(module: torch.nn.Module, device: torch.device) -> None:
    """Make ``device`` current (CUDA) and move the module's parameters and buffers there (the
    run does it before ``configure_optimizers``, so the optimizers hold the moved parameters)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    module.to(device)


def move_to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor inside tuples, lists, dicts and namedtuples on ``device``."""
    return _move(value, device, device.type == "cuda")


def _move(value: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_move(item, device, non_blocking) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_move(item, device, non_blocking) for item in value)
    if isinstance(value, dict):
        moved = value.copy()  # keeps the mapping's type (OrderedDict, defaultdict, ...)
        for key, item in value.items():
            moved[key] = _move(item, device, non_blocking)
        return moved
    return value


class OnDevice:
    """A :class:`~engine.loops.contracts.BatchRunner` that moves each batch to the run's device
    before the level below (split loop or whole batch) sees it: once per batch, not per split."""

    def __init__(self, runner: BatchRunner, device: torch.device) -> None:
        self.runner = runner
        self.device = device

    def run_batch(self, batch: Any, batch_index: int) -> Losses | None:
        return self.runner.run_batch(move_to_device(batch, self.device), batch_index)

    def skip_batch(self) -> None:
        self.runner.skip_batch()

    def end_epoch(self) -> None:
        self.runner.end_epoch()
