"""Every exception the engine raises on purpose, in one tree::

    EngineError
    ├── ConfigError              a TrainerConfig / CheckpointConfig field is invalid, an argument unknown
    ├── ModuleContractError      the user's module broke its contract (step output, optimizers)
    │   └── SplitError           a batch could not be split for TBPTT
    ├── DataError                the data source cannot be used (empty, wrong type)
    ├── CheckpointError
    │   ├── CheckpointNotFound   no (valid) checkpoint where one was asked for
    │   ├── CheckpointCorrupt    a file is torn, truncated, tampered with or hostile
    │   ├── CheckpointIncompatible  the checkpoint does not match the current run
    │   │   └── WorldSizeChangeRefused  it cannot continue on this number of ranks
    │   ├── CheckpointWriteError a checkpoint could not be written (I/O error, bad state)
    │   ├── WriterConflict       another process is writing checkpoints to the same run dir
    │   └── ReplicaDivergence    the ranks of a distributed run disagree on replicated state
    ├── AnomalyError             a numerical anomaly the run cannot roll back past (Rollback)
    ├── GroupStartTimeout        a rank of a torchrun group did not arrive within start_timeout
    └── InjectedFault            raised by the fault-injection harness (engine.faults)

The engine's warnings go through :func:`warn`, which attributes them to the user's line: a
fixed ``stacklevel`` points at the right line only from the one depth it was counted for (the
same warning raised through ``engine.lightning.Trainer.fit``, a resume, or a DataLoader's worker
setup pointed into the engine instead); :func:`warn` walks out of the engine's own frames (and
the ``contextlib`` frames of its context managers) to the first frame beyond them.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
import warnings


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class ConfigError(EngineError, ValueError, TypeError):
    """A configuration field is invalid, or an argument unknown; the message names the field,
    the value and what was expected. Also a TypeError: an unknown keyword argument of
    ``TrainerConfig``, ``CheckpointConfig``, ``Trainer`` or ``fit`` raises it where Python would
    raise TypeError (engine/unknown_keywords.py)."""


class ModuleContractError(EngineError, TypeError):
    """The user's module returned or declared something the engine cannot use."""


class SplitError(ModuleContractError):
    """A batch cannot be split along the time dimension."""


class DataError(EngineError, ValueError):
    """The training data cannot be used as given."""


class CheckpointError(EngineError):
    """Base of checkpoint errors."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No checkpoint, or no valid one, where one was asked for."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint file does not verify or does not parse; nothing from it was used."""


class CheckpointIncompatible(CheckpointError):
    """The checkpoint was written by a run that differs from the current one."""


class WorldSizeChangeRefused(CheckpointIncompatible):
    """A distributed checkpoint cannot be resumed on another number of ranks (carried hidden
    state, a sampler the engine cannot re-partition, a global batch the new world size does not
    divide, ...); the message names the reason and what would work (docs/distributed.md)."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed; earlier checkpoints are untouched."""


class WriterConflict(CheckpointError):
    """Another live process holds the run directory's writer lease."""


class ReplicaDivergence(CheckpointError):
    """The ranks of a distributed run hold different replicated state (parameters, optimizer,
    progress) at a checkpoint; the checkpoint is not committed. Never downgraded to a warning."""


class AnomalyError(EngineError):
    """A non-finite or spiking loss (or non-finite gradients) that ``Rollback`` cannot roll back
    past: ``max_rollbacks`` reached, or no checkpoint old enough."""


class GroupStartTimeout(EngineError):
    """The ranks of a torchrun group did not all arrive within ``TrainerConfig.start_timeout``;
    the message names the ranks that did not. The rank exits so that torchrun restarts the group."""


class InjectedFault(EngineError):
    """An exception raised on purpose by :mod:`engine.faults`."""


_PASS_THROUGH = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.abspath(contextlib.__file__))


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the first caller outside the engine."""
    warnings.warn(message, category, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The ``stacklevel`` :func:`warn` passes: 1 is warn itself, 2 the engine code that called it."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and (os.path.abspath(frame.f_code.co_filename).startswith(_PASS_THROUGH)
                                        or _is_generated_init(frame)):
        frame, level = frame.f_back, level + 1
    return level


def _is_generated_init(frame: types.FrameType) -> bool:
    """A dataclass's ``__init__`` (compiled from a string): the configuration's own warnings
    pass through it to the user's line."""
    return frame.f_code.co_name == "__init__" and frame.f_code.co_filename == "<string>"
