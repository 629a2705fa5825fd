"""Hugging Face ``datasets`` streams: their state loading, repaired.

``datasets`` 5.x loads a stream's state by re-creating each stage's state dict; a stage that
loads its inner stage's state while it iterates (``RebatchedArrowExamplesIterable`` does) then
keeps pointing at the inner stage's old dict, so after a resume the stream's ``state_dict()``
stops following the shards: the samples are right, but a second interruption in the same epoch
would resume at the first one's position. :func:`repair_state_loading` makes the load fill the
existing dicts in place (same values, same objects), once per process, and only when the
training data is such a stream: importing the engine never imports ``datasets``.
"""

from __future__ import annotations

import copy
from typing import Any

_REPAIRED = "_splitloop_loads_in_place"


def is_hf_stream(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face ``datasets`` IterableDataset (by its class, without importing ``datasets``)."""
    return any(cls.__module__.startswith("datasets.") and cls.__name__ == "IterableDataset" for cls in type(value).__mro__)


def repair_state_loading(value: Any) -> None:
    """Make the state loading of Hugging Face streams keep its dicts (see the module docstring)."""
    if not is_hf_stream(value):
        return
    try:
        from datasets import iterable_dataset
    except ImportError:  # pragma: no cover - an object of its class exists, so it imports
        return
    base = iterable_dataset._BaseExamplesIterable
    if getattr(base.load_state_dict, _REPAIRED, False):
        return
    original = base.load_state_dict

    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> Any:
        if getattr(self, "_state_dict", None) is None:
            return original(self, state_dict)
        return _load_into(self._state_dict, state_dict)

    setattr(load_state_dict, _REPAIRED, True)
    base.load_state_dict = load_state_dict


def _load_into(state: Any, new_state: Any) -> Any:
    """``datasets``' own merge of a saved state into a live one, without re-creating the live one."""
    if new_state is not None and isinstance(state, dict):
        for key in new_state:
            state[key] = _load_into(state.get(key), new_state[key])
        return state
    if new_state is not None and isinstance(state, list) and len(state) == len(new_state):
        for index, item in enumerate(new_state):
            state[index] = _load_into(state[index], item)
        return state
    return copy.deepcopy(new_state)
