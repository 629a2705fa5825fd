"""The names under a run directory's ``checkpoints/``: ``ckpt-<sequence>`` for a checkpoint,
``tmp-<sequence>-<pid or attempt>`` for a staging directory; and the plain file names a run
directory's paths are made of (:func:`check_name`)."""

from __future__ import annotations

import re

from engine.errors import CheckpointWriteError, ConfigError

CHECKPOINT_DIR = "checkpoints"
SEQUENCE_DIGITS = 10
MAX_SEQUENCE = 10 ** SEQUENCE_DIGITS - 1
# ASCII digits only (``\d`` would also match other scripts' digits), a fixed width, whole name.
CHECKPOINT_NAME = re.compile(r"ckpt-([0-9]{10})", re.ASCII)
STAGING_NAME = re.compile(r"tmp-([0-9]{10})-[0-9]+", re.ASCII)
# A file or directory name the run directory may hold (engine.checkpoint.store.storage).
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


def checkpoint_name(sequence: int) -> str:
    """``ckpt-`` and the sequence as exactly ten digits; refuses what does not fit."""
    if isinstance(sequence, bool) or not isinstance(sequence, int) or not 0 <= sequence <= MAX_SEQUENCE:
        raise CheckpointWriteError(
            f"checkpoint sequence {sequence!r} does not fit in {SEQUENCE_DIGITS} digits: a name such as "
            f"ckpt-{MAX_SEQUENCE} in checkpoints/ uses up the numbering. Remove stray ckpt-* entries or "
            "start the run in a new directory"
        )
    return f"ckpt-{sequence:010d}"


def sequence_of(name: str) -> int:
    """The sequence of the checkpoint name ``name`` (which must be one)."""
    match = CHECKPOINT_NAME.fullmatch(name)
    assert match is not None, name
    return int(match.group(1))


def check_name(name: str, what: str = "name") -> str:
    """Refuse anything but a plain file name (no separators, no '..', no hidden names)."""
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name) or ".." in name:
        raise ConfigError(f"{what}: {name!r} is not a plain file name (letters, digits, '.', '_', '-')")
    return name
