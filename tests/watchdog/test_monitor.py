"""The monitor thread in process: it runs during ``fit`` and only then, the word it reads moves
with every split, and on a stalled word it reports (line, row, stacks) and calls its hang action."""

from __future__ import annotations

import json
import threading
import time

import pytest

import engine
import scenarios
from engine.watchdog import phases, tracker as trackers
from engine.watchdog.board import AloneBoard, NodeBoard
from engine.watchdog.monitor import Monitor
from engine.watchdog import word as words
from engine.watchdog.word import REPORTED, WRITER_WAITS_FOR_PEERS


class WordSeen(engine.Callback):
    """Records, at each split end, the split count of this process's word and the watchdog threads."""

    def __init__(self) -> None:
        self.splits: list[int] = []
        self.threads: list[int] = []

    def on_split_end(self, view: engine.RunView) -> None:
        tracker = trackers.current()
        assert tracker is not None
        self.splits.append(tracker.splits)
        self.threads.append(sum(thread.name == "splitloop-watchdog" for thread in threading.enumerate()))


def test_the_monitor_runs_during_fit_only_and_the_word_counts_the_splits() -> None:
    model, loader = scenarios.build("tbptt")
    seen = WordSeen()
    config = engine.TrainerConfig(max_epochs=1, progress_bar="off", **scenarios.SCENARIOS["tbptt"].config_kwargs())
    engine.Trainer(config, callbacks=[seen]).fit(model, loader)
    assert seen.splits == list(range(1, len(seen.splits) + 1)) and len(seen.splits) > 3
    assert set(seen.threads) == {1}
    assert trackers.current() is None
    assert not any(thread.name == "splitloop-watchdog" for thread in threading.enumerate())


class Appended:
    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def append(self, relative: str, data: bytes) -> None:
        self.files[relative] = self.files.get(relative, b"") + data


def test_a_stalled_word_is_reported_with_the_stacks_and_ends_the_process(capsys: pytest.CaptureFixture[str]) -> None:
    policy = engine.Watchdog(min_timeout_s=0.2, first_timeout_s=0.2, poll_s=0.01)
    board = AloneBoard()
    tracker = trackers.PhaseTracker(policy, board.buffer, rank=0)
    tracker.split_done(phases.BOUNDARY)
    storage, ended = Appended(), threading.Event()
    monitor = Monitor(policy, tracker, board, storage, on_hang=ended.set)
    monitor.start()
    try:
        assert ended.wait(10.0)
    finally:
        monitor.stop()
        board.close()
    assert tracker.flags & REPORTED
    row = json.loads(storage.files["hangs.jsonl"])
    assert (row["rank"], row["phase"], row["last_split"], row["reported_by"]) == (0, "boundary", 1, 0)
    assert row["stalled_s"] >= 0.2 and "test_a_stalled_word_is_reported" in row["stacks"]
    err = capsys.readouterr().err
    assert "rank 0" in err and "hung in phase 'boundary'" in err and "test_a_stalled_word_is_reported" in err


def test_a_moving_word_is_never_reported() -> None:
    policy = engine.Watchdog(min_timeout_s=0.3, first_timeout_s=0.3, poll_s=0.01)
    board = AloneBoard()
    tracker = trackers.PhaseTracker(policy, board.buffer, rank=0)
    hung = threading.Event()
    monitor = Monitor(policy, tracker, board, None, on_hang=hung.set)
    monitor.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            tracker.split_done(phases.BOUNDARY)
            time.sleep(0.01)
    finally:
        monitor.stop()
        board.close()
    assert not hung.is_set()


def test_a_resumed_run_counts_the_runs_splits(tmp_path) -> None:
    first = WordSeen()
    scenarios.train_with_checkpoints("tbptt", str(tmp_path), epochs=1, callbacks=(first,))
    second = WordSeen()
    scenarios.train_with_checkpoints("tbptt", str(tmp_path), epochs=2, callbacks=(second,))
    assert second.splits[0] == first.splits[-1] + 1  # the run's split count, not this fit's


def two_ranks_of_a_node(tmp_path, flags_of_rank_1: int) -> tuple[Monitor, threading.Event]:
    """Rank 0's monitor (not started) on a node board where rank 1 has ``flags_of_rank_1``."""
    policy = engine.Watchdog(min_timeout_s=5.0, first_timeout_s=5.0, poll_s=0.01)
    ranks = {rank: trackers.PhaseTracker(policy, NodeBoard(str(tmp_path), rank).buffer, rank) for rank in (0, 1)}
    ranks[0].split_done(phases.BACKWARD)
    ranks[1].split_done(phases.STEP)
    if flags_of_rank_1:
        ranks[1].set_flag(flags_of_rank_1)
    ended = threading.Event()
    return Monitor(policy, ranks[0], NodeBoard(str(tmp_path), 0), None, on_hang=ended.set), ended


def test_an_error_after_a_peer_reported_its_hang_ends_the_rank_with_the_hang_code(tmp_path, capsys) -> None:
    # The peer's exit closes its connections: this rank's collective raises; torchrun must see the
    # hang exit code from every rank, not exit 1 from the ranks that waited for it.
    monitor, ended = two_ranks_of_a_node(tmp_path, REPORTED)
    monitor.end_if_a_peer_hung(RuntimeError("Connection closed by peer [127.0.0.1]:20108"))
    assert ended.is_set()
    err = capsys.readouterr().err
    assert "rank 1 hung and reported it; rank 0 ends too" in err and "Connection closed by peer" in err


def test_an_error_of_the_rank_itself_is_left_to_raise(tmp_path, capsys) -> None:
    monitor, ended = two_ranks_of_a_node(tmp_path, 0)
    monitor.end_if_a_peer_hung(RuntimeError("the model's own error"))
    assert not ended.is_set() and "ends too" not in capsys.readouterr().err


def test_an_interrupt_is_left_to_raise_even_after_a_peer_reported_its_hang(tmp_path) -> None:
    monitor, ended = two_ranks_of_a_node(tmp_path, REPORTED)
    monitor.end_if_a_peer_hung(KeyboardInterrupt())
    assert not ended.is_set()


def test_the_same_error_is_looked_at_once(tmp_path) -> None:
    # The run's exception path and the watch both pass the fit's error: the second look would
    # only repeat the first (a store read that can wait 5 s when the store is gone).
    monitor, ended = two_ranks_of_a_node(tmp_path, 0)
    error = RuntimeError("the model's own error")
    monitor.end_if_a_peer_hung(error)
    trackers.PhaseTracker(engine.Watchdog(min_timeout_s=5.0), NodeBoard(str(tmp_path), 1).buffer, 1).set_flag(REPORTED)
    monitor.end_if_a_peer_hung(error)
    assert not ended.is_set()
    monitor.end_if_a_peer_hung(RuntimeError("Connection closed by peer"))
    assert ended.is_set()


def test_a_writer_thread_waiting_for_peers_flags_the_word_and_the_fits_thread_marks_a_collective() -> None:
    board = AloneBoard()
    tracker = trackers.PhaseTracker(engine.Watchdog(), board.buffer, 0)
    trackers.install(tracker)
    try:
        tracker.mark(phases.CHECKPOINT)
        seen: list[tuple[str, int]] = []

        def published() -> tuple[str, int]:
            word = words.read(board.buffer)
            assert word is not None
            return word.phase, word.flags & WRITER_WAITS_FOR_PEERS

        def writer() -> None:  # two writer threads at once (one abandoned, still inside): flagged until both left
            with trackers.waiting_for_peers():
                seen.append(published())
                with trackers.waiting_for_peers():
                    seen.append(published())
                seen.append(published())
            seen.append(published())

        thread = threading.Thread(target=writer)
        thread.start()
        thread.join()
        flagged = ("checkpoint", WRITER_WAITS_FOR_PEERS)
        assert seen == [flagged, flagged, flagged, ("checkpoint", 0)]
        with trackers.waiting_for_peers():
            assert published() == ("collective", 0)
        assert published() == ("checkpoint", 0)
        with trackers.waiting_for_peers(on_the_fits_thread=False):  # a commit's gather with writer="sync"
            assert published() == ("checkpoint", 0)
    finally:
        trackers.install(None)
        board.close()
