"""Hugging Face ``datasets`` streams: their state loading, repaired.

Three behaviours of ``datasets`` 5.x break a resume, and :func:`repair_state_loading` repairs
them, once per process, and only when the training data is such a stream (importing the engine
never imports ``datasets``):

* A stream loads its state by re-creating each stage's state dict; a stage that loads its inner
  stage's state while it iterates (``RebatchedArrowExamplesIterable`` does) then keeps pointing
  at the inner stage's old dict, so after a resume the stream's ``state_dict()`` stops following
  the shards: the samples are right, but a second interruption in the same epoch would resume at
  the first one's position. The load now fills the existing dicts in place (same values, same
  objects).
* ``IterableDataset.load_state_dict`` only keeps the state for the next iteration: until then
  ``state_dict()`` answers the state the stream had before (its start, laid out for the whole
  stream in the process that built it, not for a worker's shards). torchdata's
  ``StatefulDataLoader`` asks each worker for its state right after loading it, and keeps that
  answer as the worker's position until the worker yields a batch: a checkpoint taken in between
  (a resumed run killed again at once) saved the start of that worker's shards, and the next
  resume replayed them. A loaded state is now what ``state_dict()`` answers until the stream
  iterates, and a stream that has iterated nothing answers "no position yet" (see
  :func:`_state_before_iterating`).
* ``.shuffle(seed, buffer_size)`` does not save its buffer: :mod:`engine.data.hf_shuffle`.

Worker processes started with ``fork`` (the Linux default) inherit the repair.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from engine.data.hf_shuffle import load_into, save_shuffle_buffers
from engine.errors import warn as warn_user

_REPAIRED = "_splitloop_repaired"


def is_hf_stream(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face ``datasets`` IterableDataset (by its class, without importing ``datasets``)."""
    return any(cls.__module__.startswith("datasets.") and cls.__name__ == "IterableDataset" for cls in type(value).__mro__)


def repair_state_loading(value: Any) -> None:
    """Make the state loading of Hugging Face streams exact (see the module docstring)."""
    if not is_hf_stream(value):
        return
    try:
        import datasets
        from datasets import iterable_dataset
    except ImportError:  # pragma: no cover - an object of its class exists, so it imports
        return
    _replace_once(iterable_dataset._BaseExamplesIterable, "load_state_dict", _loads_in_place)
    _replace_once(iterable_dataset.IterableDataset, "load_state_dict", _answers_the_loaded_state)
    value._state_dict = _state_before_iterating(value)
    if _shuffle_buffer_known(datasets.__version__):
        save_shuffle_buffers(iterable_dataset)
    elif _has_shuffle_buffer(value):
        warn_user(f"datasets {datasets.__version__}: the content of a .shuffle() buffer is not saved (checked with "
                  f"datasets 5.2 to 5.x): a resume refills it, and the examples after it differ (docs/data.md)")


def _state_before_iterating(stream: Any) -> dict[str, Any]:
    """What a stream that has not iterated answers to ``state_dict()``: the state it loaded, or
    "no position yet", which loads as nothing (each iteration begins at the start).

    ``datasets`` answers the state dict it made when the stream was built, laid out for the
    whole stream in this process; a DataLoader worker iterates only its shards, through stages
    laid out otherwise (a shuffled stream interleaves as many shards as it reads). torchdata
    saves a worker's answer until the worker yields a batch, and a worker that loaded the whole
    stream's layout read its shards without end."""
    loaded = getattr(stream, "_starting_state_dict", None)
    return copy.deepcopy(loaded) if loaded else {"examples_iterable": None, "epoch": stream.epoch}


def _shuffle_buffer_known(version: str) -> bool:
    """Whether ``datasets`` is a version whose shuffle buffer :mod:`engine.data.hf_shuffle` reproduces (5.2 to 5.x)."""
    major, minor = (int(part) if part.isdigit() else 0 for part in (version.split(".") + ["0"])[:2])
    return major == 5 and minor >= 2


def _has_shuffle_buffer(value: Any) -> bool:
    stage = getattr(value, "_ex_iterable", None)
    while stage is not None:
        if type(stage).__name__ == "BufferShuffledExamplesIterable":
            return True
        stage = getattr(stage, "ex_iterable", None)
    return False


def _replace_once(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``cls.name`` by ``make(original)``, unless it was already."""
    original = getattr(cls, name)
    if getattr(original, _REPAIRED, False):
        return
    replacement = make(original)
    setattr(replacement, _REPAIRED, True)
    setattr(cls, name, replacement)


def _loads_in_place(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> Any:
        if getattr(self, "_state_dict", None) is None:
            return original(self, state_dict)
        return load_into(self._state_dict, state_dict)

    return load_state_dict


def _answers_the_loaded_state(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
        original(self, state_dict)
        # The next iteration re-creates it from the loaded state; until then it is the position.
        self._state_dict = copy.deepcopy(state_dict)

    return load_state_dict
