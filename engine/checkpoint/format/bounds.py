"""The largest tensor a checkpoint may describe: every shape read from a file (a tensor-table
entry, a sharded tensor's global shape) is checked against these bounds before anything is
allocated for it."""

MAX_DIMS = 64
"""The most dimensions a stored tensor (or a sharded tensor's global shape) may have."""

MAX_ELEMENTS = 1 << 40
"""The most elements a stored tensor may hold (counting a zero dimension as 1: torch still
computes strides from the others)."""

MAX_COUNT = 1 << 62
"""Offsets, sizes and shape entries read from a file lie in ``[0, MAX_COUNT)``."""


def is_count(value: object) -> bool:
    """Whether ``value`` is an int (not a bool) in ``[0, MAX_COUNT)``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_COUNT
