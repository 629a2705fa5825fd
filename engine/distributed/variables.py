"""torchrun's environment variables, read and validated without torch: the launcher
(``python -m engine launch``) and the preemption marker use them before, or without, any
process group."""

from __future__ import annotations

import os
from typing import Mapping

from engine.errors import ConfigError


def launched_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun (its elastic agent) started this process, whatever its world size."""
    return "TORCHELASTIC_RUN_ID" in (os.environ if environ is None else environ)


def requested_world_size(environ: Mapping[str, str] | None = None) -> int:
    """``WORLD_SIZE`` from the environment (1 when unset), validated."""
    environ = os.environ if environ is None else environ
    return int_variable(environ, "WORLD_SIZE", 1)


def int_variable(environ: Mapping[str, str], name: str, default: int) -> int:
    """The variable ``name`` of ``environ`` as a non-negative int (``default`` when unset)."""
    value = environ.get(name)
    if value is None:
        return default
    if not value.isdigit():
        raise ConfigError(f"environment variable {name}: expected a non-negative int, got {value!r}")
    return int(value)
