"""Stragglers (engine.watchdog.stragglers): a rank slowed 1.5x is reported once within 20 splits,
never as hung; a rank that only waits for the others is not slow."""

from __future__ import annotations

import time

import engine
from engine.watchdog import phases, tracker as trackers
from engine.watchdog.stragglers import StragglerWatch
from engine.watchdog.verdict import judge
from engine.watchdog.word import Word, new_buffer


def word(rank: int, splits: int, busy_s: float) -> Word:
    return Word(1, splits, time.monotonic_ns(), 300.0, 0.0, 0.0, busy_s, 100 + rank, rank,
                phases.CODE_OF[phases.STEP], 0, "")


def test_a_rank_slowed_one_and_a_half_times_is_reported_once_within_twenty_splits() -> None:
    watch = StragglerWatch(factor=1.3, window=10, warmup=5)
    reported_at = []
    for split in range(40):
        words = [word(0, split, 0.010), word(1, split, 0.015), word(2, split, 0.011)]
        for straggler in watch.look(words):
            reported_at.append(split)
            assert straggler.word.rank == 1 and straggler.fastest.rank == 0 and 1.49 < straggler.factor < 1.51
            assert "straggler: rank 1" in straggler.line("node7") and straggler.row("node7")["phase"] == "step"
        assert judge(words, time.monotonic_ns(), alive=lambda pid: True) is None  # slow, never hung
    assert reported_at == [15]  # from its 5th split (warm-up) on, a window of 10 splits


def test_a_rank_back_to_speed_restarts_its_window() -> None:
    watch = StragglerWatch(factor=1.3, window=10, warmup=0)
    for split in range(30):
        slow = 0.015 if split % 8 else 0.010  # fast again every 8th split: never slow for 10 in a row
        assert watch.look([word(0, split, 0.010), word(1, split, slow)]) == []


def test_waits_are_not_counted_as_a_ranks_own_work() -> None:
    tracker = trackers.PhaseTracker(engine.Watchdog(), new_buffer(), rank=0)
    for _ in range(3):
        tracker.mark(phases.STEP)
        time.sleep(0.02)
        tracker.mark(phases.COLLECTIVE)  # waiting for a slower rank
        time.sleep(0.06)
        tracker.split_done(phases.BOUNDARY)
    assert 0.015 < tracker.busy_s < 0.05
