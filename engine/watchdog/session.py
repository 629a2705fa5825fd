"""One fit under the watchdog: the word, the tracker :func:`~engine.watchdog.tracker.mark` writes
to, and the monitor thread, from before the process group is joined until ``fit`` returns."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from engine.watchdog.settings import Watchdog
from engine.watchdog import tracker as trackers
from engine.watchdog.board import AloneBoard, NodeBoard, launcher_board, shared_directory, torchrun_agent
from engine.watchdog.monitor import Monitor, end_process
from engine.watchdog.remote import RemoteBoard, group_store, several_nodes
from engine.watchdog.report import AppendOnly
from engine.watchdog.word import FINISHED, REPORTED


_monitor: Monitor | None = None  # the monitor of the fit being watched


def end_if_a_peer_hung(error: BaseException) -> None:
    """The fit is ending with ``error``: when another rank hung and reported it, end this process
    now with the hang exit code (engine.watchdog.monitor.Monitor.end_if_a_peer_hung); else return
    (no watchdog: return too)."""
    if _monitor is not None:
        _monitor.end_if_a_peer_hung(error)


@contextlib.contextmanager
def watch(policy: Watchdog | None, storage: AppendOnly | None) -> Iterator[None]:
    """Run the body under ``policy`` (None: no watchdog); hang reports go to ``storage``'s
    ``hangs.jsonl`` (None: stderr only)."""
    global _monitor
    if policy is None or trackers.current() is not None:  # a fit inside a fit (a callback's) is watched already
        yield
        return
    under_torchrun = os.environ.get("RANK", "").isdigit()
    directory = shared_directory(os.environ, agent=torchrun_agent() if under_torchrun else None)
    rank = int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else 0
    board: AloneBoard | NodeBoard = (AloneBoard() if directory is None
                                     else NodeBoard(directory, rank, keep=launcher_board(os.environ) is not None))
    tracker = trackers.PhaseTracker(policy, board.buffer, rank, storage)
    remote = None
    if directory is not None and several_nodes(os.environ):
        remote = RemoteBoard(group_store, rank, int(os.environ["WORLD_SIZE"]))
    monitor = Monitor(policy, tracker, board, storage, on_hang=lambda: _end_process(board, tracker), remote=remote)
    trackers.install(tracker)
    _monitor = monitor
    monitor.start()
    try:
        yield
    except BaseException as error:
        monitor.end_if_a_peer_hung(error)
        raise
    finally:
        _monitor = None
        tracker.set_flag(FINISHED)
        monitor.stop()
        trackers.install(None)
        board.close()


def _end_process(board: AloneBoard | NodeBoard, tracker: trackers.PhaseTracker) -> None:
    """The hung rank leaves its word (flagged REPORTED) for the other ranks of its node to read;
    a rank that ends because another hung removes the node's words (no file is left in /dev/shm)."""
    if not tracker.flags & REPORTED:
        board.remove_all()
    end_process()
