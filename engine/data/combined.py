"""Several training loaders at once, in the modes of Lightning's ``CombinedLoader``."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import torch

from engine.data.sources import EXHAUSTED, named_sources
from engine.errors import ConfigError, DataError

MODES = ("max_size_cycle", "min_size", "sequential")


class CombinedLoaders:
    """Batches from several named loaders, resumable exactly (each loader's position is saved
    as a :class:`~engine.data.mixture.Mixture` source's is). ``fit(module, {"a": ..., "b": ...},
    mode=...)`` builds one. Each batch is a dict keyed by loader name:

    * ``"max_size_cycle"``: one batch of every loader per step; a loader that runs out starts
      again, until the longest has run out;
    * ``"min_size"``: one batch of every loader per step, until the shortest runs out;
    * ``"sequential"``: every batch of the first loader, then of the second, ... (one key per batch).
    """

    def __init__(self, loaders: Mapping[str, Iterable[Any]], mode: str = "max_size_cycle") -> None:
        if mode not in MODES:
            raise ConfigError(f"fit: mode must be one of {list(MODES)} (with a dict of training loaders), got {mode!r}")
        self.mode = mode
        self._sources = named_sources(loaders, "fit")
        self._stage, self._finished, self._continuing = 0, True, False
        self._ran_out: set[str] = set()

    def close_sources(self) -> None:
        """Stop the worker processes of every source's pass in progress (the run's end)."""
        for source in self._sources:
            source.close()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not self._continuing:
            self._stage, self._finished, self._ran_out = 0, False, set()
            for source in self._sources:
                source.begin_epoch()
        self._continuing = False
        return self._batches()

    def _batches(self) -> Iterator[dict[str, Any]]:
        while True:
            batch = self._next_sequential() if self.mode == "sequential" else self._next_together()
            if batch is EXHAUSTED:
                self._finished = True
                return
            yield batch

    def _next_sequential(self) -> Any:
        while self._stage < len(self._sources):
            source = self._sources[self._stage]
            item = source.next_item()
            if item is not EXHAUSTED:
                return {source.name: item}
            self._stage += 1
        return EXHAUSTED

    def _next_together(self) -> Any:
        batch = {}
        for source in self._sources:
            item = source.next_item()
            if item is EXHAUSTED:
                self._ran_out.add(source.name)
                if self.mode == "min_size" or len(self._ran_out) == len(self._sources):
                    return EXHAUSTED
                source.restart()
                item = source.next_item()
                if item is EXHAUSTED:
                    raise DataError(f"fit: training loader {source.name!r} yields no batch; it cannot be cycled")
            batch[source.name] = item
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The stage (sequential mode), which loaders ran out, and each loader's position."""
        return {"mode": self.mode, "stage": self._stage, "finished": self._finished, "ran_out": sorted(self._ran_out),
                "sources": {source.name: source.state_dict() for source in self._sources}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next ``iter`` (or begin the next epoch when it had ended)."""
        names = sorted(source.name for source in self._sources)
        if sorted(state["sources"]) != names or state["mode"] != self.mode:
            raise DataError(f"fit: the checkpoint has training loaders {sorted(state['sources'])} in mode "
                            f"{state['mode']!r}, this run {names} in mode {self.mode!r}")
        self._stage, self._finished = int(state["stage"]), bool(state["finished"])
        self._ran_out = set(state["ran_out"])
        for source in self._sources:
            source.load_state_dict(state["sources"][source.name])
        self._continuing = not self._finished


def _is_loader(value: Any) -> bool:
    # A dict of tensors is one batch passed where batches go, not loaders (check_batch_source says so).
    return hasattr(value, "__iter__") and not isinstance(value, (str, bytes, torch.Tensor))


def combine_loaders(train_data: Any, mode: str | None) -> Any:
    """``train_data`` itself, or a dict of training loaders as :class:`CombinedLoaders`."""
    if isinstance(train_data, Mapping) and train_data and all(_is_loader(value) for value in train_data.values()):
        return CombinedLoaders(train_data, "max_size_cycle" if mode is None else mode)
    if mode is not None:
        raise ConfigError(f"fit: mode={mode!r} applies to a dict of training loaders, got {type(train_data).__name__}")
    return train_data
