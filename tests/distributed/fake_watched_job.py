"""A stand-in for torchrun whose workers publish progress words as the engine's fit does, without
torch: ``fake_watched_job.py KIND_OF_RANK_0 KIND_OF_RANK_1 ...``. Each worker gets torchrun's
variables (run id, rank, world size, restart count) and the launcher's board variable, which it
inherits. Like torchrun, the agent exits 1 when a worker fails (after stopping the others) and
0 when every worker succeeds.

Worker kinds:
``arrives``: publishes a word that waits to join the process group, as the engine's does, then waits;
``arrives_then_exits``: the same, then exits 0 after 2 s;
``starting``: publishes a word still starting (detail "restoring"), then waits;
``silent``: publishes nothing (it never reached fit), waits; ``silent_then_exits``: exits 0 after 2 s;
``crash_loop``: publishes a word, then stops a crash loop as the engine does (exit 87);
``hang``: publishes a word, leaves a hang outcome as the watchdog does, exits 86.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

WORKER = """
import os, sys, time
from engine.watchdog import HANG_EXIT_CODE, JOINING, STARTING
from engine.watchdog.board import NodeBoard, shared_directory
from engine.watchdog.crash_loop import stop_the_loop
from engine.watchdog.outcomes import record_outcome
from engine.watchdog.settings import Watchdog
from engine.watchdog.tracker import PhaseTracker

kind, rank = sys.argv[1], int(os.environ["RANK"])
if not kind.startswith("silent"):
    board = NodeBoard(shared_directory(os.environ), rank, keep=True)
    tracker = PhaseTracker(Watchdog(), board.buffer, rank)
    if kind == "starting":
        tracker.mark("starting", "restoring")
    else:
        tracker.mark(STARTING, JOINING)
if kind == "crash_loop":
    raise stop_the_loop("deterministic failure at split 3: the same exception twice (ValueError: boom)")
if kind == "hang":
    record_outcome(HANG_EXIT_CODE, f"rank {rank} hung in phase 'step'")
    os._exit(HANG_EXIT_CODE)
time.sleep(2.0 if kind.endswith("then_exits") else 3600)
"""


def main() -> int:
    kinds = sys.argv[1:]
    base = {**os.environ, "TORCHELASTIC_RUN_ID": "fake", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "0",
            "WORLD_SIZE": str(len(kinds))}
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, kind], start_new_session=True,
                                env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)})
               for rank, kind in enumerate(kinds)]
    while True:
        statuses = [worker.poll() for worker in workers]
        if any(status not in (None, 0) for status in statuses):
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
            return 1
        if all(status == 0 for status in statuses):
            return 0
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
