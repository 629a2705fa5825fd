"""The names of per-rank files inside a checkpoint (``rank-NNNNN.bin`` / ``.msgpack``).

Kept in the checkpoint package, which lists and verifies them; the distributed package decides
what goes into them (engine/distributed/state_parts.py)."""

from __future__ import annotations

import re

_RANK_FILE = re.compile(r"rank-([0-9]{5})\.(bin|msgpack)", re.ASCII)


def rank_files(rank: int) -> tuple[str, str]:
    """The tensor file and the header file of ``rank``'s part."""
    return f"rank-{rank:05d}.bin", f"rank-{rank:05d}.msgpack"


def is_rank_file(name: str) -> bool:
    """Whether ``name`` is a per-rank file of a checkpoint (``rank-NNNNN.bin|msgpack``)."""
    return _RANK_FILE.fullmatch(name) is not None
