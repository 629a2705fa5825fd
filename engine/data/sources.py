"""One named source of a :class:`~engine.data.mixture.Mixture` or of several training loaders,
and its position: how many items its current pass gave, how many passes it began, and its own
``state_dict()`` when it has one.

A source resumes in O(1) when it has ``state_dict()`` / ``load_state_dict()`` (its state is
loaded) or is a sequence (a list, a tuple: indexed from the position on); any other iterable is
replayed, its items drawn and dropped (one warning says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Iterable, Iterator

import torch

from engine.data.hf_streams import repair_state_loading
from engine.data.rng import capture_global_rng, restore_global_rng
from engine.data.streams import drop_batches, has_state, over_stream_with_state, with_saved_position
from engine.data.workers import has_workers, shut_down_workers
from engine.errors import warn as warn_user

EXHAUSTED = object()


class Source:
    """A named iterable with a resumable position (see the module docstring)."""

    def __init__(self, name: str, iterable: Iterable[Any]) -> None:
        self.name = name
        repair_state_loading(getattr(iterable, "dataset", iterable))
        # As in engine.data.position.EpochData: between passes only the main process's copy of a
        # stream in a DataLoader carries over (loading the StatefulDataLoader's state of a finished
        # pass would skip the DataLoader's seed draw at the next pass).
        self._stream = getattr(iterable, "dataset", None) if over_stream_with_state(iterable) else None
        self._stream_carries_over = self._stream is not None and not has_workers(iterable)
        self.iterable = with_saved_position(iterable)
        self.drawn = 0  # items given in the current pass
        self.passes = 0  # passes begun (a cycled source begins several per epoch)
        self.exhausted = False  # the current pass ended
        self._iterator: Iterator[Any] | None = None
        self._resume_at: int | None = None  # reopen the current pass after this many items (after a resume)
        self._loaded_state: Any = None

    def begin_epoch(self) -> None:
        """Forget the previous epoch's pass: the next item begins a new pass."""
        self._settle_loaded_state()
        self.close()
        self.drawn, self.passes, self.exhausted, self._resume_at = 0, 0, False, None

    def restart(self) -> None:
        """Begin a new pass (a cycled source that ran out)."""
        self._settle_loaded_state()
        self.close()
        self.drawn, self.exhausted, self._resume_at = 0, False, None

    def close(self) -> None:
        """Stop the worker processes of the pass in progress (a pass left before its end, as
        ``min_size`` leaves the longer loaders, keeps them prefetching until it is collected,
        and a process exiting with them alive waits for them)."""
        if self._iterator is not None:
            shut_down_workers(self._iterator)
            self._iterator = None

    def next_item(self) -> Any:
        """The source's next item, or EXHAUSTED at the end of its pass."""
        if self.exhausted:
            return EXHAUSTED
        if self._iterator is None:
            self._iterator = self._open()
        item = next(self._iterator, EXHAUSTED)
        if item is EXHAUSTED:
            self.exhausted = True
        else:
            self.drawn += 1
        return item

    def _open(self) -> Iterator[Any]:
        skip, self._resume_at = self._resume_at, None
        if skip is None:
            self.passes += 1
            return iter(self.iterable)
        if skip == 0 or has_state(self.iterable):
            return self._reopen()
        if isinstance(self.iterable, Sequence):
            return iter(self.iterable[skip:])
        warn_user(f"resuming source {self.name!r} ({type(self.iterable).__name__}) by drawing and dropping "
                  f"{skip:,} items: it has no state_dict() and is not a sequence (docs/data.md)")
        iterator = iter(self.iterable)
        drop_batches(iterator, skip)
        return iterator

    def _settle_loaded_state(self) -> None:
        """A pass left before it was reopened after a resume: open it once, as the interrupted run
        did, so that the next ``iter`` begins a new pass (a StatefulDataLoader applies a loaded
        state at its next ``iter``, whenever that comes)."""
        if self._iterator is None and self._resume_at is not None and has_state(self.iterable):
            shut_down_workers(self._reopen())

    def _reopen(self) -> Iterator[Any]:
        """Open the pass a checkpoint interrupted (its loaded state holds the position). What the
        opening draws (a DataLoader draws its workers' seed) was drawn before the checkpoint in
        the run that was interrupted: it is undone here."""
        generator = getattr(self.iterable, "generator", None)
        generator_state = generator.get_state() if isinstance(generator, torch.Generator) else None
        now = capture_global_rng()
        iterator = iter(self.iterable)
        restore_global_rng(now)
        if generator_state is not None:
            generator.set_state(generator_state)  # type: ignore[union-attr]
        return iterator

    def state_dict(self) -> dict[str, Any]:
        opened = self._iterator is not None or self._resume_at is not None
        # Loaded but not reopened yet: the state is the loaded one (a StatefulDataLoader asked for
        # its state before iter() starts an iterator, and draws its workers' seed, to answer).
        state = self._loaded_state if self._iterator is None and self._resume_at is not None else \
            self._own_state(between_passes=self.exhausted or not opened)
        return {"drawn": self.drawn, "passes": self.passes, "exhausted": self.exhausted, "opened": opened,
                "state": state}

    def _own_state(self, between_passes: bool) -> Any:
        if self._stream is not None and between_passes:
            return self._stream.state_dict() if self._stream_carries_over else None
        return self.iterable.state_dict() if has_state(self.iterable) else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drawn, self.passes, self.exhausted = int(state["drawn"]), int(state["passes"]), bool(state["exhausted"])
        self._iterator = None
        self._resume_at = self.drawn if state["opened"] else None
        self._loaded_state = state["state"]
        if state["state"] is None:
            return
        if self._stream is not None and (self.exhausted or not state["opened"]):
            self._stream.load_state_dict(state["state"])
        elif has_state(self.iterable):
            self.iterable.load_state_dict(state["state"])


def named_sources(sources: Any, owner: str) -> list[Source]:
    """``sources`` (a mapping name -> iterable, or a sequence of iterables named "0", "1", ...)
    as :class:`Source` objects; ``owner`` names the caller in errors."""
    from engine.errors import ConfigError

    items = list(sources.items()) if hasattr(sources, "items") else [(str(i), s) for i, s in enumerate(sources)]
    if not items:
        raise ConfigError(f"{owner}: sources is empty; give at least one iterable")
    for name, iterable in items:
        if not isinstance(name, str) or not hasattr(iterable, "__iter__"):
            raise ConfigError(f"{owner}: source {name!r} must be an iterable named by a str, got "
                              f"{type(iterable).__name__}")
    return [Source(name, iterable) for name, iterable in items]
