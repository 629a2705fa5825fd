"""Metrics logged with ``Module.log(name, value, reduce=...)``: per split, per epoch, per validation.

A :class:`MetricLogger` is bound to the module for one fit. Values logged during a training split
are reduced within the split (a step may run once per optimizer) and become that split's row; the
same values also feed the epoch's running aggregate, whose state is checkpointed, so a run killed
halfway through an epoch resumes with its partial sums. A validation pass aggregates into its own
:class:`Aggregate`. ``latest`` keeps the newest value of every name (what ``FitResult.metrics``
and ``RunView.metrics`` show).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch

from engine.errors import ModuleContractError

Reduce = Literal["mean", "sum", "max", "min", "last"]
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "max", "min", "last")
_LOGGED = "self.log"


class Aggregate:
    """Running reductions of named values: ``{name: [reduce, accumulated, count]}``. A ``mean``
    may weight its values (Lightning's ``batch_size``): it accumulates value * weight and counts
    the weights."""

    def __init__(self) -> None:
        self.entries: dict[str, list[Any]] = {}

    def add(self, name: str, value: float, reduce: str, weight: int | float = 1) -> None:
        if reduce == "mean":
            value, count = value * weight, weight
        else:
            count = 1
        entry = self.entries.get(name)
        if entry is None:
            self.entries[name] = [reduce, value, count]
            return
        if entry[0] != reduce:
            raise ModuleContractError(f"metric {name!r} was logged with reduce={entry[0]!r} and then reduce={reduce!r}")
        entry[1] = _combine(reduce, entry[1], value)
        entry[2] += count

    def values(self) -> dict[str, float]:
        """The reduced value of every name (``mean`` divides by the count)."""
        return {name: accumulated / count if reduce == "mean" else accumulated
                for name, (reduce, accumulated, count) in self.entries.items()}

    def clear(self) -> None:
        self.entries = {}

    def state_dict(self) -> dict[str, Any]:
        return {name: list(entry) for name, entry in self.entries.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        entries = {}
        for name, entry in state.items():
            reduce, accumulated, count = entry
            if reduce not in REDUCTIONS or isinstance(count, bool) or not isinstance(count, (int, float)):
                raise ValueError(f"metric {name!r}: malformed aggregate {entry!r}")
            entries[str(name)] = [reduce, float(accumulated), count]
        self.entries = entries


def _combine(reduce: str, accumulated: float, value: float) -> float:
    if reduce in ("mean", "sum"):
        return accumulated + value
    if reduce == "max":
        return max(accumulated, value)
    if reduce == "min":
        return min(accumulated, value)
    return value


class MetricLogger:
    """The sink behind ``Module.log`` for one fit."""

    def __init__(self) -> None:
        self.split = Aggregate()
        self.epoch = Aggregate()
        self.evaluation: Aggregate | None = None
        self.latest: dict[str, float] = {}
        # Names seen in each pass of this fit: one name in both would mix the two in ``latest``
        # (what monitor, EarlyStopping and FitResult.metrics read).
        self._names: dict[str, set[str]] = {"training": set(), "validation": set()}
        # Names logged for the split's row only (Lightning's on_epoch=False): not aggregated over the epoch.
        self._split_only: set[str] = set()
        # Where each name of the running validation pass came from: validation_step's returned
        # value or self.log. One name from both would be averaged together, so it is refused.
        self._evaluation_sources: dict[str, str] = {}

    def log(self, name: str, value: Any, reduce: str, weight: int | float = 1, per_split: bool = True,
            per_epoch: bool = True) -> None:
        """Record ``value`` under ``name`` in the pass that is running (training or validation).

        In training, ``per_split`` puts it in the split's row and ``per_epoch`` in the epoch's
        aggregate (both by default: the split's reduced value joins the epoch's; with only
        ``per_epoch`` the value itself does, weighted by ``weight`` in a mean). A validation
        value always joins the pass's aggregate, weighted by ``weight``."""
        self._check_source(name, _LOGGED)
        if not per_split and not per_epoch:
            raise ModuleContractError(f"log({name!r}): a value logged neither per split nor per epoch goes nowhere")
        self._add(name, value, reduce, weight, per_split, per_epoch)

    def log_returned(self, name: str, value: Any, returned_as: str) -> None:
        """Record a value ``validation_step`` returned (averaged over the pass); ``returned_as``
        says how, for the error that refuses a name also logged with ``self.log``."""
        self._check_source(name, f"returned by validation_step {returned_as}")
        self._add(name, value, "mean")

    def _check_source(self, name: str, source: str) -> None:
        if self.evaluation is None or not isinstance(name, str):
            return
        first = self._evaluation_sources.setdefault(name, source)
        if first != source:
            returned = first if source == _LOGGED else source
            raise ModuleContractError(
                f"validation: {name!r} is both {returned} and logged with self.log({name!r}, ...), which would "
                f"average the two; return it or log it, not both (or log the other value under another name)")

    def _add(self, name: str, value: Any, reduce: str, weight: int | float = 1, per_split: bool = True,
             per_epoch: bool = True) -> None:
        if not isinstance(name, str) or not name:
            raise ModuleContractError(f"log: the name must be a non-empty string, got {name!r}")
        if reduce not in REDUCTIONS:
            raise ModuleContractError(f"log({name!r}): reduce must be one of {list(REDUCTIONS)}, got {reduce!r}")
        number = _as_float(name, value)
        stage, other = ("validation", "training") if self.evaluation is not None else ("training", "validation")
        if name not in self._names[stage]:
            if name in self._names[other]:
                # A warning, not an error: code written for frameworks where this is common keeps
                # training; metrics.jsonl keeps both (each line names its stage).
                warnings.warn(
                    f"log({name!r}) in {stage}: the name was logged in {other} too, so the two overwrite each "
                    "other in the latest values that monitor, EarlyStopping and FitResult.metrics read; use "
                    "different names in training and validation (e.g. 'train_acc' and 'val_acc'; validation's "
                    "returned loss is logged as 'val_loss')", stacklevel=3)
            self._names[stage].add(name)
        if self.evaluation is not None:
            self.evaluation.add(name, number, reduce, weight)
        elif per_split:
            self.split.add(name, number, reduce)
            if not per_epoch:
                self._split_only.add(name)
        else:
            self.epoch.add(name, number, reduce, weight)

    def end_split(self) -> dict[str, float]:
        """The split's reduced values (they also join the epoch's aggregate)."""
        if not self.split.entries:
            return {}
        values = self.split.values()
        for name, (reduce, _, _) in self.split.entries.items():
            if name not in self._split_only:
                self.epoch.add(name, values[name], reduce)
        self.split.clear()
        self._split_only.clear()
        self.latest.update(values)
        return values

    def end_epoch(self) -> dict[str, float]:
        """The epoch's aggregates of the training values; the aggregate starts over."""
        values = self.epoch.values()
        self.epoch.clear()
        self.latest.update(values)
        return values

    def begin_evaluation(self) -> None:
        self.evaluation = Aggregate()
        self._evaluation_sources = {}

    def end_evaluation(self) -> dict[str, float]:
        values = {} if self.evaluation is None else self.evaluation.values()
        self.evaluation = None
        self.latest.update(values)
        return values

    def state_dict(self) -> dict[str, Any]:
        # Taken at boundaries, where no split or validation is half done.
        return {"epoch": self.epoch.state_dict(), "latest": dict(self.latest)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch.load_state_dict(state["epoch"])
        self.latest = {str(name): float(value) for name, value in state["latest"].items()}


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ModuleContractError(f"log({name!r}): expected a scalar, got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModuleContractError(f"log({name!r}): expected a number or a scalar tensor, got {type(value).__name__}")
    return float(value)
