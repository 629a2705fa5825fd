"""The two Linux ``prctl`` calls that tie a launched job's processes to their supervisor.

* ``PR_SET_CHILD_SUBREAPER``: orphaned descendants become this process's children instead of
  init's (the launcher keeps the workers of a torchrun that died).
* ``PR_SET_PDEATHSIG``: the kernel sends this process a signal when its parent dies (torchrun
  dies with a SIGKILLed launcher; a worker is asked to stop when its torchrun dies). The
  "parent" is the thread that started the process: torchrun and the launcher start their
  children from their main thread.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_prctl: Callable[..., int] | None = None


def load() -> Callable[..., int]:
    """libc's ``prctl``, resolved once: call this in the parent before a fork whose
    ``preexec_fn`` sets a parent-death signal (the child must not load libraries)."""
    global _prctl
    if _prctl is None:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    return _prctl


def _call(option: int, value: int) -> None:
    if load()(option, value, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl({option}, {value}): {os.strerror(error)}")


def set_child_subreaper(enabled: bool) -> None:
    """Make orphaned descendants of this process its children (``enabled``) or init's again."""
    _call(_PR_SET_CHILD_SUBREAPER, int(enabled))


def set_parent_death_signal(number: int) -> None:
    """Have the kernel send ``number`` to this process when the thread that started it ends
    (0: nothing). Cleared in children; kept across exec."""
    _call(_PR_SET_PDEATHSIG, number)
