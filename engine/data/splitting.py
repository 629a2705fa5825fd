"""The default TBPTT splitter: cut every tensor of a batch along the time dimension."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from engine.errors import SplitError

Batch = Any  # a tensor, or tuples / lists / dicts of tensors and plain values


def split_along_time(batch: Batch, split_length: int, time_dim: int = 1) -> list[Batch]:
    """Cut each tensor in ``batch`` into pieces of ``split_length`` along ``time_dim`` (the last
    piece may be shorter) and regroup them into one batch of the same structure per split.

    Values that are not tensors are repeated unchanged in every split. Raises SplitError when
    the batch holds no tensor, a tensor has no ``time_dim``, or tensors disagree on its length,
    and when ``split_length`` is not a positive int or ``time_dim`` not an int.
    """
    for name, value, low in (("split_length", split_length, 1), ("time_dim", time_dim, None)):
        if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
            raise SplitError(f"split_along_time: {name} must be {'a positive int' if low else 'an int'}, got {value!r}")
    lengths: set[int] = set()
    _collect_time_lengths(batch, time_dim, lengths)
    if not lengths:
        raise SplitError(
            f"cannot split a batch of type {type(batch).__name__} for TBPTT: it holds no tensor "
            "(expected a tensor or tuples/lists/dicts of tensors; override Module.split_batch otherwise)"
        )
    if len(lengths) > 1:
        raise SplitError(
            f"cannot split the batch for TBPTT: its tensors have different lengths {sorted(lengths)} "
            f"along time dim {time_dim}; override Module.split_batch for such batches"
        )
    length = lengths.pop()
    if length == 0:
        raise SplitError(f"cannot split the batch for TBPTT: its time dim {time_dim} has length 0")
    starts = range(0, length, split_length)
    return [_slice(batch, time_dim, start, min(split_length, length - start)) for start in starts]


def _collect_time_lengths(value: Batch, time_dim: int, lengths: set[int]) -> None:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or not -value.dim() <= time_dim < value.dim():
            raise SplitError(
                f"cannot split a tensor of shape {tuple(value.shape)} along time dim {time_dim}: "
                "it has no such dimension (set Module.tbptt_time_dim, or override Module.split_batch)"
            )
        lengths.add(value.shape[time_dim])
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect_time_lengths(item, time_dim, lengths)
    elif isinstance(value, dict):
        for item in value.values():
            _collect_time_lengths(item, time_dim, lengths)


def _slice(value: Batch, time_dim: int, start: int, length: int) -> Batch:
    if isinstance(value, torch.Tensor):
        return value.narrow(time_dim, start, length)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_slice(item, time_dim, start, length) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_slice(item, time_dim, start, length) for item in value)
    if isinstance(value, dict):
        return {key: _slice(item, time_dim, start, length) for key, item in value.items()}
    return value


def check_splits(splits: Sequence[Batch], batch_index: int) -> Sequence[Batch]:
    """Validate what a (possibly user-overridden) splitter returned."""
    if not isinstance(splits, Sequence) or isinstance(splits, (str, bytes, torch.Tensor)):
        raise SplitError(
            f"split_batch must return a list of splits, got {type(splits).__name__} for batch {batch_index}"
        )
    if len(splits) == 0:
        raise SplitError(f"split_batch returned no split for batch {batch_index}")
    return splits
