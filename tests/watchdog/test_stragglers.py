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
        assert judge(words, time.monotonic_ns(), alive=lambda w: True) is None  # slow, never hung
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


def tracker_average(previous: float, split_s: float) -> float:
    """The word's busy time after one more split of ``split_s`` (the tracker's moving average)."""
    return split_s if previous == 0.0 else (1 - trackers._SMOOTHING) * previous + trackers._SMOOTHING * split_s


def test_a_rank_alone_slowed_one_and_a_half_times_is_reported_against_its_own_history_within_twenty_splits() -> None:
    watch = StragglerWatch(factor=1.3, window=10, warmup=5)
    busy, reported_at = 0.0, []
    for split in range(1, 200):
        busy = tracker_average(busy, 0.010 if split <= 100 else 0.015)  # slowed from split 101 on
        words = [word(0, split, busy)]
        for straggler in watch.look(words):
            reported_at.append(split)
            assert straggler.fastest is None and 1.4 < straggler.factor < 1.51 and 0.0099 < straggler.baseline_s < 0.0106
            assert "as it did before" in straggler.line("node7")
            assert straggler.row("node7")["against"] == "own history"
        assert judge(words, time.monotonic_ns(), alive=lambda w: True) is None  # slow, never hung
    assert len(reported_at) == 1 and 101 < reported_at[0] <= 120, reported_at


def test_the_noise_of_a_shared_machine_is_no_straggler_against_its_own_history() -> None:
    import random

    rng = random.Random(7)
    watch = StragglerWatch(factor=1.3, window=10, warmup=5)
    busy = 0.0
    for split in range(1, 3000):
        busy = tracker_average(busy, 0.010 * rng.uniform(0.8, 1.2) * (2.0 if rng.random() < 0.02 else 1.0))
        assert watch.look([word(0, split, busy)]) == [], split


def test_a_rank_slower_than_its_peers_is_reported_once_against_the_fastest_not_again_against_its_history() -> None:
    watch = StragglerWatch(factor=1.3, window=10, warmup=0)
    found = [straggler for split in range(1, 60) for straggler in
             watch.look([word(0, split, 0.010), word(1, split, 0.010 if split < 20 else 0.016)])]
    assert [(straggler.word.rank, straggler.fastest is not None) for straggler in found] == [(1, True)], found
