"""``python -m engine launch [--marker PATH] [--exit-code N] -- torchrun ...``.

Runs the command (torchrun, or srun + torchrun) with ``SPLITLOOP_PREEMPTION_MARKER`` set, so
rank 0 of a preempted run leaves a marker once its preemption checkpoint has committed. The
launcher exits with ``--exit-code`` (75, "requeue me") when the marker is there, else with the
command's own status. SIGTERM / SIGINT / SIGUSR1 reaching the launcher are passed on to the
command. See docs/preemption.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from types import FrameType
from typing import Sequence

from engine.distributed.preemption_marker import MARKER_VARIABLE
from engine.errors import ConfigError

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def launch(command: Sequence[str], marker: str | None = None, exit_code: int = 75) -> int:
    """Run ``command``; ``exit_code`` when the run committed a preemption checkpoint, else the
    command's exit status."""
    if not command:
        raise ConfigError("launch: no command given; usage: python -m engine launch -- torchrun ... train.py")
    if marker is None:
        marker = os.path.join(tempfile.gettempdir(), f"splitloop-preempted-{os.getpid()}.json")
    if os.path.exists(marker):
        os.remove(marker)  # a marker of an earlier run must not turn this one into a preemption
    environment = {**os.environ, MARKER_VARIABLE: marker}
    try:
        process = subprocess.Popen(list(command), env=environment)
    except OSError as error:
        raise ConfigError(f"launch: cannot start {command[0]!r}: {error}") from error

    def forward(number: int, frame: FrameType | None) -> None:
        process.send_signal(number)

    previous = {number: signal.signal(number, forward) for number in FORWARDED_SIGNALS}
    try:
        status = process.wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if not os.path.exists(marker):
        return status if status >= 0 else 128 - status
    with open(marker, encoding="utf-8") as handle:
        record = json.load(handle)
    os.remove(marker)
    print(f"splitloop launch: the run was preempted ({record.get('reason')}); checkpoint "
          f"{record.get('checkpoint')} committed; exiting with {exit_code}", file=sys.stderr, flush=True)
    return exit_code
