"""Several streams interleaved by weight, resumable exactly and in O(1)."""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Any, Iterable, Iterator, Literal, Mapping, Sequence

from engine.data.sources import EXHAUSTED, Source, named_sources
from engine.errors import ConfigError, DataError

OnExhausted = Literal["stop", "cycle", "drop"]
_ON_EXHAUSTED = ("stop", "cycle", "drop")


class Mixture:
    """Items (batches) drawn from several sources, each position from one source chosen by weight.

    Which source position ``p`` of epoch ``e`` comes from is a counter-based draw: a hash of
    ``(seed, e, p)`` turned into a number in [0, 1) and looked up in the cumulative weights of
    the sources still in play. It depends on nothing else, so a resumed run makes the same
    choices without replaying any; each source's position is saved (its own ``state_dict()``
    when it has one, else how many items it gave: a list is indexed from there, any other
    iterable is replayed with a warning). What happens when the chosen source runs out:

    * ``"stop"``: the epoch ends;
    * ``"cycle"``: the source starts a new pass; the epoch ends once every source ran out once;
    * ``"drop"``: the source leaves the mixture (the others' weights are renormalised); the
      epoch ends when none is left.

    Args:
        sources: iterables yielding batches, as a mapping name -> iterable (names appear in
            ``inspect``) or a sequence (named "0", "1", ...).
        weights: one non-negative weight per source (in the order of ``sources``), not all 0.
        seed: the seed of the choices.
        on_exhausted: "stop", "cycle" or "drop".

    Example::

        data = Mixture({"web": web_loader, "code": code_loader}, weights=[0.7, 0.3], seed=0)
        Trainer(config).fit(module, data)
    """

    def __init__(self, sources: Mapping[str, Iterable[Any]] | Sequence[Iterable[Any]], weights: Sequence[float],
                 seed: int = 0, on_exhausted: OnExhausted = "stop") -> None:
        self._sources = named_sources(sources, "Mixture")
        self._weights = _checked_weights(weights, len(self._sources))
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"Mixture: seed must be an int, got {seed!r}")
        if on_exhausted not in _ON_EXHAUSTED:
            raise ConfigError(f"Mixture: on_exhausted must be one of {list(_ON_EXHAUSTED)}, got {on_exhausted!r}")
        self.seed, self.on_exhausted = seed, on_exhausted
        self.epoch, self.position, self._finished, self._continuing = -1, 0, True, False
        self._live = list(range(len(self._sources)))
        self._ran_out: set[int] = set()

    def close_sources(self) -> None:
        """Stop the worker processes of every source's pass in progress (the run's end)."""
        for source in self._sources:
            source.close()

    def __iter__(self) -> Iterator[Any]:
        if not self._continuing:
            self._begin_epoch()
        self._continuing = False
        return self._items()

    def _begin_epoch(self) -> None:
        self.epoch, self.position, self._finished = self.epoch + 1, 0, False
        self._live, self._ran_out = list(range(len(self._sources))), set()
        for source in self._sources:
            source.begin_epoch()

    def _items(self) -> Iterator[Any]:
        while True:
            item = self._next_item()
            if item is EXHAUSTED:
                self._finished = True
                return
            yield item

    def _next_item(self) -> Any:
        while self._live:
            index = self._choose()
            source = self._sources[index]
            item = source.next_item()
            if item is not EXHAUSTED:
                self.position += 1
                return item
            if source.drawn == 0 and self.on_exhausted == "cycle":
                raise DataError(f"Mixture: source {source.name!r} yields nothing; it cannot be cycled")
            self._ran_out.add(index)
            if self.on_exhausted == "stop" or (self.on_exhausted == "cycle" and len(self._ran_out) == len(self._sources)):
                return EXHAUSTED
            if self.on_exhausted == "drop":
                self._live.remove(index)
            else:
                source.restart()
        return EXHAUSTED

    def _choose(self) -> int:
        """The source of the current position: depends only on (seed, epoch, position) and the live sources."""
        digest = hashlib.blake2b(struct.pack("<qqq", self.seed, self.epoch, self.position), digest_size=8).digest()
        point = int.from_bytes(digest, "little") / 2.0 ** 64 * sum(self._weights[i] for i in self._live)
        for index in self._live:
            point -= self._weights[index]
            if point < 0:
                return index
        return self._live[-1]  # rounding at the very top of the range

    def state_dict(self) -> dict[str, Any]:
        """The epoch, the position in it, the sources in play and each source's position."""
        return {"epoch": self.epoch, "position": self.position, "finished": self._finished,
                "live": [self._sources[i].name for i in self._live],
                "ran_out": [self._sources[i].name for i in sorted(self._ran_out)],
                "sources": {source.name: source.state_dict() for source in self._sources}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next ``iter`` resumes its epoch (or begins the next one
        when that epoch had ended)."""
        names = [source.name for source in self._sources]
        if sorted(state["sources"]) != sorted(names):
            raise DataError(f"Mixture: the checkpoint has sources {sorted(state['sources'])}, this mixture {sorted(names)}")
        self.epoch, self.position, self._finished = int(state["epoch"]), int(state["position"]), bool(state["finished"])
        self._live = [names.index(name) for name in state["live"]]
        self._ran_out = {names.index(name) for name in state["ran_out"]}
        for source in self._sources:
            source.load_state_dict(state["sources"][source.name])
        self._continuing = not self._finished


def _checked_weights(weights: Sequence[float], count: int) -> list[float]:
    values = list(weights)
    if len(values) != count:
        raise ConfigError(f"Mixture: weights has {len(values)} entries for {count} sources; give one weight per source")
    if any(isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0 for w in values) \
            or sum(values) <= 0:
        raise ConfigError(f"Mixture: weights must be finite non-negative numbers, not all 0, got {values!r}")
    return [float(w) for w in values]


def source_positions(loader_state: Any) -> dict[str, dict[str, int]] | None:
    """Each source's position in a Mixture's (or several loaders') saved state, for ``inspect``;
    None for other states."""
    if not isinstance(loader_state, dict) or not isinstance(loader_state.get("sources"), dict):
        return None
    return {str(name): {"drawn": int(s["drawn"]), "passes": int(s["passes"])}
            for name, s in loader_state["sources"].items() if isinstance(s, dict) and "drawn" in s}
