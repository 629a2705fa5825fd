"""The engine's warnings, attributed to the user's line.

A fixed ``stacklevel`` points at the right line only from the one depth it was counted for: the
same warning raised through ``engine.lightning.Trainer.fit``, a resume, or a DataLoader's
worker setup pointed into the engine instead. :func:`warn` walks out of the engine's own frames
(and the ``contextlib`` frames of its context managers) and attributes the warning to the first
frame beyond them: the user's ``fit`` call, or their code that called into the engine.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

_PASS_THROUGH = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.abspath(contextlib.__file__))


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the first caller outside the engine."""
    warnings.warn(message, category, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The ``stacklevel`` :func:`warn` passes: 1 is warn itself, 2 the engine code that called it."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PASS_THROUGH):
        frame, level = frame.f_back, level + 1
    return level
