"""A wait for a hung background writer thread (on_io_error="warn") ends at the watchdog's deadline:
the thread's checkpoint is abandoned, reported (hangs.jsonl) and counted as not written, a new
thread writes what follows, and the stuck thread, once it returns, commits and deletes nothing
(its fence fails) and reports nothing (in-process, no monitor thread)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import threading
import time
from typing import Iterator

import pytest
import torch

from engine import Watchdog
from engine.checkpoint.format.codec import encode_state
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.retention import Retention
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.writers.pending import PendingCheckpoint
from engine.checkpoint.writers.writer import BackgroundWriter
from engine.errors import CheckpointWriteError
from engine.watchdog import HANGS_FILE, WRITER, tracker as trackers
from engine.watchdog.word import new_buffer
from progress import ProgressTree, encode_tree


def pending(value: float) -> PendingCheckpoint:
    return PendingCheckpoint(encode_state({"weights": torch.full((3,), value)}), encode_tree(ProgressTree()), None)


@dataclasses.dataclass
class StuckWriter:
    """A background writer whose first write hangs until ``leave`` is set (``entered``: it did)."""

    storage: Storage
    store: CheckpointStore
    writer: BackgroundWriter
    entered: threading.Event
    leave: threading.Event


@contextlib.contextmanager
def stuck_writer(tmp_path: pathlib.Path, when_behind: str, policy: Watchdog | None = None,
                 hang_at: int = 1) -> Iterator[StuckWriter]:
    """The writer's ``hang_at``-th write hangs until ``leave`` is set."""
    storage = Storage(str(tmp_path / "run"))
    store = CheckpointStore(storage)
    policy = policy or Watchdog(min_timeout_s=0.3, first_timeout_s=0.3, warmup=1, poll_s=0.05)
    trackers.install(trackers.PhaseTracker(policy, new_buffer(), 0, storage))
    writer = BackgroundWriter(store, None, Retention(keep_last=1), lambda: [], max_in_flight=1, when_behind=when_behind,
                              abandon_hung=True)
    entered, leave = threading.Event(), threading.Event()
    original = store.write
    writes = iter(range(1, 1 << 30))

    def write(request, callbacks):  # type: ignore[no-untyped-def]
        if next(writes) == hang_at:  # hangs until the test lets it go
            entered.set()
            assert leave.wait(60)
        return original(request, callbacks)

    store.write = write  # type: ignore[method-assign]
    try:
        yield StuckWriter(storage, store, writer, entered, leave)
    finally:
        leave.set()
        writer.close()
        trackers.install(None)


def test_a_stuck_writer_thread_is_abandoned_and_can_never_commit_or_delete(tmp_path: pathlib.Path) -> None:
    with stuck_writer(tmp_path, "wait") as stuck:
        writer, store = stuck.writer, stuck.store
        writer.submit(pending(1.0))
        assert stuck.entered.wait(30)
        thread = writer._thread
        writer.submit(pending(2.0))  # no free snapshot until the deadline: the stuck one is abandoned
        writer.flush()
        assert writer._thread is not thread and thread.is_alive()
        with pytest.raises(CheckpointWriteError, match="was abandoned"):
            writer.check()
        committed = sorted(store.committed_names())
        assert len(committed) == 1 and writer.last_name == committed[0]
        writer.check()  # its failure is not reported: it was abandoned


def test_with_when_behind_skip_a_stuck_writer_thread_is_abandoned_at_a_check(tmp_path: pathlib.Path) -> None:
    # "skip" never waits for the thread: the split boundary's check looks at how long it has had its checkpoint.
    with stuck_writer(tmp_path, "skip") as stuck:
        writer, store = stuck.writer, stuck.store
        writer.submit(pending(1.0))
        assert stuck.entered.wait(30)
        writer.check()  # within the timeout: nothing
        assert not writer.submit(pending(1.5))  # skipped: the one buffer is being written
        time.sleep(0.4)
        with pytest.raises(CheckpointWriteError, match="was abandoned"):
            writer.check()
        rows = [json.loads(line) for line in stuck.storage.read(HANGS_FILE).decode().splitlines()]
        assert len(rows) == 1 and rows[0]["phase"] == "waiting for the writer" and rows[0]["stalled_s"] >= 0.3, rows
        assert writer.submit(pending(2.0))
        writer.flush()
        committed = sorted(store.committed_names())
        assert len(committed) == 1 and torch.equal(store.load(committed[0]).state["weights"], torch.full((3,), 2.0))


def test_a_wait_for_the_writer_is_timed_by_its_writes_from_when_the_hung_write_began(tmp_path: pathlib.Path) -> None:
    # Writes fast enough that training never waits for them: the waits teach nothing, the writes
    # do. The fourth write hangs; training runs on for a while before it needs the writer again.
    # The wait is then already past the writes' learned timeout, counted from when the hung write
    # began: it is abandoned at once, not after the first allowance (60 s) from the wait's start.
    policy = Watchdog(min_timeout_s=0.3, factor=5.0, first_timeout_s=60.0, warmup=3, poll_s=0.05)
    with stuck_writer(tmp_path, "wait", policy, hang_at=4) as stuck:
        writer = stuck.writer
        for value in range(3):
            writer.submit(pending(float(value)))
            writer.flush()
        statistics = trackers.current().statistics  # type: ignore[union-attr]
        assert statistics.quantiles(WRITER) is not None  # learned from the three writes
        learned = statistics.timeout(WRITER, splits_done=3)
        assert learned < 60.0
        writer.submit(pending(3.0))
        assert stuck.entered.wait(30)
        time.sleep(learned + 0.2)  # the rank's own work, while the write hangs
        waited_from = time.monotonic()
        writer.submit(pending(4.0))  # waits for the one snapshot buffer: the hung write is abandoned
        waited = time.monotonic() - waited_from
        with pytest.raises(CheckpointWriteError, match="was abandoned"):
            writer.check()
        rows = [json.loads(line) for line in stuck.storage.read(HANGS_FILE).decode().splitlines()]
        assert len(rows) == 1 and rows[0]["phase"] == "waiting for the writer", rows
        # Counted from the write's start (it had lasted the sleep), against the learned timeout.
        assert rows[0]["stalled_s"] >= learned + 0.2 > rows[0]["timeout_s"] == pytest.approx(learned), rows
        assert waited < 30.0  # not the first allowance
        writer.flush()
        committed = sorted(stuck.store.committed_names())
        assert torch.equal(stuck.store.load(committed[-1]).state["weights"], torch.full((3,), 4.0))
