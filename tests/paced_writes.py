"""Background checkpoint writes (and durable-tier copies) whose length is counted in training
splits, not in seconds.

A test that needs a write to still be running while training goes on (to see snapshots
skipped, or splits that overlapped a write) used to make each write sleep a while: on a loaded
machine the splits were then as slow as the sleep and nothing overlapped. Here a write on the
writer thread lasts until the training thread has finished ``splits`` more splits, whatever
the speed of either; the test calls :meth:`PacedWrites.split_done` at each split end (from a
callback, :attr:`PacedWrites.callback`, or a wrapper of its own). A write that no split will
ever follow (the last checkpoint of a run, or one that training waits for) ends after
``at_most_seconds``: only how long the run takes depends on that, never what it does.
"""

from __future__ import annotations

import threading

import engine
from engine.checkpoint.store import CheckpointStore


class PacedWrites:
    def __init__(self, monkeypatch, splits: int = 1, at_most_seconds: float = 0.5) -> None:
        self.splits = splits
        self.at_most_seconds = at_most_seconds
        self._done = threading.Condition()
        self._splits_done = 0
        self._in_flight = 0
        paced = self
        # A fast tier's copies into the durable tier run in the background too: paced alike, so
        # that how many splits a copy overlaps does not depend on the disk and the load.
        for method in ("write", "copy_from"):
            monkeypatch.setattr(CheckpointStore, method, _paced(paced, getattr(CheckpointStore, method)))
        self.callback = _SplitEnds(self)

    def split_done(self) -> None:
        """The training thread finished a split."""
        with self._done:
            self._splits_done += 1
            self._done.notify_all()

    def wait_until_idle(self, timeout: float = 10.0) -> None:
        """Block the caller (the training thread) until no paced write or copy is running: the
        split after this call then overlaps only work started after it, however slow the disk."""
        with self._done:
            self._done.wait_for(lambda: self._in_flight == 0, timeout=timeout)

    def _started(self) -> None:
        with self._done:
            self._in_flight += 1

    def _ended(self) -> None:
        with self._done:
            self._in_flight -= 1
            self._done.notify_all()

    def _wait_for_splits(self) -> None:
        with self._done:
            target = self._splits_done + self.splits
            self._done.wait_for(lambda: self._splits_done >= target, timeout=self.at_most_seconds)


def _paced(paced: PacedWrites, original):
    def background_work_waits_for_splits(store, *args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            return original(store, *args, **kwargs)
        paced._started()
        try:
            paced._wait_for_splits()
            return original(store, *args, **kwargs)
        finally:
            paced._ended()

    return background_work_waits_for_splits


class _SplitEnds(engine.Callback):
    """Tells :class:`PacedWrites` about every split end (on the training thread)."""

    def __init__(self, paced: PacedWrites) -> None:
        self._paced = paced

    def on_split_end(self, view: engine.RunView) -> None:
        self._paced.split_done()
