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
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.tiers.fast import DurablePromoter
from engine.checkpoint.writers.writer import BackgroundWriter


class PacedWrites:
    def __init__(self, monkeypatch, splits: int = 1, at_most_seconds: float = 0.5) -> None:
        self.splits = splits
        self.at_most_seconds = at_most_seconds
        self._done = threading.Condition()
        self._splits_done = 0
        # The worker threads in a paced write or copy, from its start until their worker marks
        # itself idle: only then has the engine recorded when the work ended (``last_end``,
        # which decides whether the next split overlapped it).
        self._busy: set[threading.Thread] = set()
        paced = self
        # A fast tier's copies into the durable tier run in the background too: paced alike, so
        # that how many splits a copy overlaps does not depend on the disk and the load.
        for method in ("write", "copy_from"):
            monkeypatch.setattr(CheckpointStore, method, _paced(paced, getattr(CheckpointStore, method)))
        for worker in (BackgroundWriter, DurablePromoter):
            monkeypatch.setattr(worker, "_idle_locked", _ending(paced, worker._idle_locked))
        self.callback = _SplitEnds(self)

    def split_done(self) -> None:
        """The training thread finished a split."""
        with self._done:
            self._splits_done += 1
            self._done.notify_all()

    def wait_until_idle(self, timeout: float = 10.0) -> None:
        """Block the caller (the training thread) until no paced write or copy is running and
        its worker has recorded its end: the split after this call then overlaps only work
        started after it, however slow the disk and however the threads are scheduled."""
        with self._done:
            self._done.wait_for(lambda: not self._busy, timeout=timeout)

    def _started(self) -> None:
        with self._done:
            self._busy.add(threading.current_thread())

    def _ended(self) -> None:
        with self._done:
            self._busy.discard(threading.current_thread())
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
        paced._wait_for_splits()
        return original(store, *args, **kwargs)

    return background_work_waits_for_splits


def _ending(paced: PacedWrites, original):
    def idle_after_recording_the_end(worker):
        original(worker)
        paced._ended()

    return idle_after_recording_the_end


class _SplitEnds(engine.Callback):
    """Tells :class:`PacedWrites` about every split end (on the training thread)."""

    def __init__(self, paced: PacedWrites) -> None:
        self._paced = paced

    def on_split_end(self, view: engine.RunView) -> None:
        self._paced.split_done()
