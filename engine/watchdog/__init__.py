"""Hang detection (docs/faults.md, "Hangs"): every rank publishes a progress word (splits
completed, phase, when the phase began, its timeout) that a monitor thread reads; a rank whose
word has not moved for its phase's timeout is reported (rank, host, phase, duration, last split,
stacks) on stderr and in ``hangs.jsonl``, and the process exits with :data:`HANG_EXIT_CODE`.

The loops, the run and the checkpoint waits call :func:`mark` when they change phase;
``engine.TrainerConfig.watchdog`` (``engine.Watchdog``) configures it. On several nodes the words
also cross nodes through the group's store (:mod:`~engine.watchdog.remote`); ``python -m engine
launch`` reads its workers' words to name a rank that never arrives (:mod:`~engine.watchdog.arrival`)
and the outcomes they leave it (:mod:`~engine.watchdog.outcomes`).
"""

from engine.watchdog.phases import (
    BACKWARD,
    BOUNDARY,
    CHECKPOINT,
    COLLECTIVE,
    CRASH_LOOP_EXIT_CODE,
    DATA,
    FINISHING,
    HANG_EXIT_CODE,
    JOINING,
    OPTIMIZER,
    PHASES,
    STARTING,
    STEP,
    VALIDATION,
    WRITER,
)
from engine.watchdog.report import HANGS_FILE
from engine.watchdog.session import end_if_a_peer_hung, watch
from engine.watchdog.tracker import mark, resumed_at, split_done, waiting_for_peers, write_took

__all__ = [
    "BACKWARD", "BOUNDARY", "CHECKPOINT", "COLLECTIVE", "CRASH_LOOP_EXIT_CODE", "DATA", "FINISHING", "HANGS_FILE",
    "HANG_EXIT_CODE", "JOINING", "OPTIMIZER", "PHASES", "STARTING", "STEP", "VALIDATION", "WRITER", "end_if_a_peer_hung", "mark", "resumed_at", "split_done",
    "waiting_for_peers", "watch", "write_took",
]
