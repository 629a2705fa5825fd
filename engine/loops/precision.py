"""Numeric precision of the step: autocast around it and, for float16, a gradient scaler.

The loop tree builds one of these from ``TrainerConfig.precision`` (:func:`make_precision`) and
hands it to the flow, which calls it at fixed places; no flow checks the setting itself::

    with precision.autocast():          # "32": nothing; mixed: torch.autocast(device type, dtype)
        loss = step(...)
    precision.backward(loss)            # "16-mixed": backward of loss * scale
    precision.unscale(optimizer)        # before clipping: gradients back to their true values
    precision.step(optimizer)           # "16-mixed": skipped when a gradient is inf/nan
    precision.update()                  # once per optimizer-step boundary: adapt the scale

Accumulated gradients of an open window are scaled by the current scale; the scale changes
only in :meth:`update`, at the end of a window, so a checkpoint inside a window holds the
gradients together with the scale they were scaled by (both are restored).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from engine.errors import ConfigError

_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class Precision:
    """Full float32 precision ("32"): no autocast, plain backward and step."""

    name = "32"

    def autocast(self) -> ContextManager[Any]:
        """The context the step runs in."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring ``optimizer``'s gradients to their true values (before clipping)."""

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        """Adapt the loss scale after the optimizer steps of one boundary."""

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"the checkpoint holds gradient-scaler state {sorted(state)} but this run's "
                             f"precision is {self.name!r}")


class MixedPrecision(Precision):
    """Autocast to ``dtype`` around the step ("bf16-mixed"; "16-mixed" adds a scaler)."""

    def __init__(self, name: str, device_type: str) -> None:
        self.name = name
        self._device_type = device_type
        self._dtype = _AUTOCAST_DTYPES[name]

    def autocast(self) -> ContextManager[Any]:
        return torch.autocast(self._device_type, dtype=self._dtype)


class ScaledMixedPrecision(MixedPrecision):
    """float16 autocast with a :class:`torch.amp.GradScaler` ("16-mixed")."""

    def __init__(self, device_type: str) -> None:
        super().__init__("16-mixed", device_type)
        self._scaler = torch.amp.GradScaler(device_type)

    @property
    def scaler(self) -> torch.amp.GradScaler:
        return self._scaler

    def backward(self, loss: torch.Tensor) -> None:
        self._scaler.scale(loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        self._scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self._scaler.step(optimizer)

    def update(self) -> None:
        self._scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self._scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"scaler"}:
            raise ValueError(f"this run's precision is '16-mixed' but the checkpoint holds no gradient-scaler "
                             f"state (keys {sorted(state)}); it was written with another precision")
        self._scaler.load_state_dict(state["scaler"])


def make_precision(name: str, device: torch.device) -> Precision:
    """The precision object for ``TrainerConfig.precision`` on ``device``."""
    if name == "32":
        return Precision()
    if name == "bf16-mixed":
        return MixedPrecision(name, device.type)
    if name == "16-mixed":
        return ScaledMixedPrecision(device.type)
    raise ConfigError(f"TrainerConfig.precision: expected one of ['32', 'bf16-mixed', '16-mixed'], got {name!r}")
