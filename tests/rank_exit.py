"""How a torchrun test script's rank leaves once its ``main`` returned."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def leave(status: int | None) -> NoReturn:
    """Exit with ``status``; a finished rank (status 0 or None) leaves without the interpreter's
    teardown: torch's gloo threads torn down there abort it now and then ("terminate called
    without an active exception", SIGABRT). Any other status (75: preempted) exits as usual, at
    the pace torchrun's own shutdown expects (leaving at once let torchrun see a failed worker
    before its own SIGTERM and restart the group)."""
    if status:
        sys.exit(status)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
