"""Metrics logged with ``Module.log(name, value, reduce=..., sync=...)``: per split, per epoch, per validation.

A :class:`MetricLogger` is bound to the module for one fit. Values logged during a training split
are reduced within the split (a step may run once per optimizer) and become that split's row; the
same values also feed the epoch's running aggregate, whose state is checkpointed, so a run killed
halfway through an epoch resumes with its partial sums. ``latest`` keeps the newest value of every
name (what ``FitResult.metrics`` and ``RunView.metrics`` show).

Across the ranks of a torchrun job, a reduction is always that of the ranks' values concatenated
in rank order, computed by every rank from every rank's contribution (never an ``all_reduce``,
whose order is the backend's), so it is the same bits on every rank and every rerun:

* a training value logged with ``sync=True``: each rank's split aggregate (accumulated value and
  count) is combined in rank order ("mean" is the sum over ranks over the count over ranks);
  without ``sync`` each rank keeps its own value (rank 0's is written);
* a validation pass: each rank records every value it logged (:class:`Recording`), and the
  pass's values are those of the recordings replayed in rank order, value by value. A rank
  validates a contiguous block of the validation batches (engine.distributed.sampler), so the
  replay adds the same values in the same order as one process validating every batch: the
  reduced values are the single-process ones, bit for bit.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import msgpack
import torch

from engine.errors import ModuleContractError, warn as warn_user

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

    def merge(self, name: str, accumulated: float, count: int | float, reduce: str) -> None:
        """Combine another aggregate's entry (its accumulated value over ``count`` values) into
        this one's, as if its values had been added after this one's."""
        entry = self.entries.get(name)
        if entry is None:
            self.entries[name] = [reduce, accumulated, count]
            return
        if entry[0] != reduce:
            raise ModuleContractError(f"metric {name!r} was logged with reduce={entry[0]!r} on one rank and "
                                      f"reduce={reduce!r} on another")
        entry[1] = _combine(reduce, entry[1], accumulated)
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


class Recording:
    """Every value logged under each name, in order, with its weight:
    ``{name: (reduce, [[value, weight], ...])}``. Replayed into an :class:`Aggregate` it reduces
    as if the values had been added to it directly."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[str, list[list[float]]]] = {}

    def add(self, name: str, value: float, reduce: str, weight: int | float = 1) -> None:
        entry = self.entries.setdefault(name, (reduce, []))
        if entry[0] != reduce:
            raise ModuleContractError(f"metric {name!r} was logged with reduce={entry[0]!r} and then reduce={reduce!r}")
        entry[1].append([value, weight])

    def replay_into(self, aggregate: Aggregate) -> None:
        for name, (reduce, values) in self.entries.items():
            for value, weight in values:
                aggregate.add(name, value, reduce, weight)

    def encode(self) -> bytes:
        return msgpack.packb([[name, reduce, values] for name, (reduce, values) in self.entries.items()])

    @classmethod
    def decode(cls, payload: bytes) -> "Recording":
        recording = cls()
        for name, reduce, values in msgpack.unpackb(payload):
            recording.entries[str(name)] = (str(reduce), [[float(value), float(weight)] for value, weight in values])
        return recording


def reduce_recordings(recordings: Sequence[Recording]) -> dict[str, float]:
    """The values of ``recordings`` (one per rank, in rank order) reduced as one sequence."""
    aggregate = Aggregate()
    for recording in recordings:
        recording.replay_into(aggregate)
    return aggregate.values()


class MetricLogger:
    """The sink behind ``Module.log`` for one fit."""

    def __init__(self) -> None:
        self.split = Aggregate()
        self.epoch = Aggregate()
        self.evaluation: Recording | None = None
        # Whether each name of the running split was logged with sync=True.
        self._sync_of: dict[str, bool] = {}
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
            per_epoch: bool = True, sync: bool = False) -> None:
        """Record ``value`` under ``name`` in the pass that is running (training or validation).

        In training, ``per_split`` puts it in the split's row and ``per_epoch`` in the epoch's
        aggregate (both by default: the split's reduced value joins the epoch's; with only
        ``per_epoch`` the value itself does, weighted by ``weight`` in a mean). A validation
        value always joins the pass's aggregate, weighted by ``weight``. ``sync``: a training
        value reduced across ranks at the split's end (validation values always are)."""
        if not isinstance(sync, bool):
            raise ModuleContractError(f"log({name!r}): sync must be True or False, got {sync!r}")
        self._check_source(name, _LOGGED)
        if not per_split and not per_epoch:
            raise ModuleContractError(f"log({name!r}): a value logged neither per split nor per epoch goes nowhere")
        if sync and not per_split:
            raise ModuleContractError(f"log({name!r}): sync=True reduces the split's value across ranks; a value "
                                      "logged per epoch only is not synced (log it per split too)")
        self._add(name, value, reduce, weight, per_split, per_epoch)
        if self.evaluation is None and per_split:
            self._check_sync(name, sync)

    def _check_sync(self, name: str, sync: bool) -> None:
        if self._sync_of.setdefault(name, sync) != sync:
            raise ModuleContractError(
                f"log({name!r}): logged with sync=True and with sync=False in one split; a value is either reduced "
                "across ranks or not: pass the same sync every time")

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
                warn_user(
                    f"log({name!r}) in {stage}: the name was logged in {other} too, so the two overwrite each "
                    "other in the latest values that monitor, EarlyStopping and FitResult.metrics read; use "
                    "different names in training and validation (e.g. 'train_acc' and 'val_acc'; validation's "
                    "returned loss is logged as 'val_loss')")
            self._names[stage].add(name)
        if self.evaluation is not None:
            self.evaluation.add(name, number, reduce, weight)
        elif per_split:
            self.split.add(name, number, reduce)
            if not per_epoch:
                self._split_only.add(name)
        else:
            self.epoch.add(name, number, reduce, weight)

    def synced_split_payload(self) -> bytes:
        """The split's values logged with ``sync=True`` (accumulated value and count of each), for
        the other ranks; empty when there are none."""
        synced = [[name, *self.split.entries[name]] for name, sync in self._sync_of.items() if sync]
        return msgpack.packb(synced) if synced else b""

    def end_split(self, synced: Sequence[bytes] = ()) -> dict[str, float]:
        """The split's reduced values (they also join the epoch's aggregate). ``synced``: every
        rank's :meth:`synced_split_payload` in rank order (empty in a single process, where
        ``sync`` changes nothing); the values logged with ``sync=True`` are their combination."""
        if not self.split.entries and not synced:
            return {}
        merged = _merge_in_rank_order(synced)
        values = {**self.split.values(), **merged.values()}
        reduces = {name: entry[0] for name, entry in (*self.split.entries.items(), *merged.entries.items())}
        for name, value in values.items():
            if name not in self._split_only:
                self.epoch.add(name, value, reduces[name])
        self.split.clear()
        self._split_only.clear()
        self._sync_of = {}
        self.latest.update(values)
        return values

    def end_epoch(self) -> dict[str, float]:
        """The epoch's aggregates of the training values; the aggregate starts over."""
        values = self.epoch.values()
        self.epoch.clear()
        self.latest.update(values)
        return values

    def begin_evaluation(self) -> None:
        self.evaluation = Recording()
        self._evaluation_sources = {}

    def end_evaluation(self) -> Recording:
        """What this process logged in the pass that ends (see :func:`reduce_recordings`)."""
        recording = Recording() if self.evaluation is None else self.evaluation
        self.evaluation = None
        return recording

    def publish_evaluation(self, values: dict[str, float]) -> None:
        """Make a pass's reduced ``values`` the latest."""
        self.latest.update(values)

    def state_dict(self) -> dict[str, Any]:
        # Taken at boundaries, where no split or validation is half done.
        return {"epoch": self.epoch.state_dict(), "latest": dict(self.latest)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch.load_state_dict(state["epoch"])
        self.latest = {str(name): float(value) for name, value in state["latest"].items()}


def _merge_in_rank_order(payloads: Sequence[bytes]) -> Aggregate:
    """The ranks' :meth:`MetricLogger.synced_split_payload` combined in rank order."""
    merged = Aggregate()
    for payload in payloads:
        if not payload:
            continue
        for name, reduce, accumulated, count in msgpack.unpackb(payload):
            merged.merge(str(name), float(accumulated), count, str(reduce))
    return merged


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ModuleContractError(f"log({name!r}): expected a scalar, got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModuleContractError(f"log({name!r}): expected a number or a scalar tensor, got {type(value).__name__}")
    return float(value)
