"""The watchdog's configuration, its learned per-phase timeouts, and the progress word's record."""

from __future__ import annotations

import threading
import time

import pytest

import engine
from engine.errors import ConfigError
from engine.watchdog import phases, word as words
from engine.watchdog.statistics import WRITE, PhaseStatistics, percentile
from engine.watchdog import tracker as trackers
from engine.watchdog.tracker import PhaseTracker


def test_the_watchdog_is_on_by_default_with_timeouts_of_minutes() -> None:
    policy = engine.TrainerConfig().watchdog
    assert isinstance(policy, engine.Watchdog)
    assert policy.min_timeout_s >= 120 and policy.first_timeout_s >= policy.min_timeout_s
    assert engine.TrainerConfig(watchdog=None).watchdog is None


@pytest.mark.parametrize("fields, named", [({"min_timeout_s": 0}, "min_timeout_s"), ({"factor": 0.5}, "factor"),
                                           ({"warmup": 0}, "warmup"), ({"poll_s": -1.0}, "poll_s"),
                                           ({"first_timeout_s": float("inf")}, "first_timeout_s")])
def test_a_bad_watchdog_field_is_named(fields: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        engine.Watchdog(**fields)


def test_a_watchdog_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(ConfigError, match="TrainerConfig.watchdog"):
        engine.TrainerConfig(watchdog=300)  # type: ignore[arg-type]


def test_a_phase_gets_the_first_allowance_until_its_warm_up_then_factor_times_its_p99() -> None:
    policy = engine.Watchdog(min_timeout_s=2.0, factor=5.0, first_timeout_s=100.0, warmup=4)
    statistics = PhaseStatistics(policy)
    for _ in range(3):
        statistics.add(phases.STEP, 1.0)
    assert statistics.timeout(phases.STEP, splits_done=3) == 100.0 and statistics.quantiles(phases.STEP) is None
    statistics.add(phases.STEP, 3.0)
    assert statistics.timeout(phases.STEP, splits_done=4) == 15.0  # 5 x the p99 of [1, 1, 1, 3]
    assert statistics.quantiles(phases.STEP) == (1.0, 3.0)
    # A phase not learned yet: the first allowance in the first splits, min_timeout_s after them,
    # except for the phases that are slow the first times (a validation pass, a restore).
    assert statistics.timeout(phases.CHECKPOINT, splits_done=3) == 100.0
    assert statistics.timeout(phases.CHECKPOINT, splits_done=4) == 2.0
    assert statistics.timeout(phases.VALIDATION, splits_done=400) == 100.0
    assert statistics.timeout(phases.WRITER, splits_done=400) == 100.0
    quick = PhaseStatistics(policy)
    for _ in range(4):
        quick.add(phases.DATA, 0.001)
    assert quick.timeout(phases.DATA, splits_done=0) == 2.0  # never below min_timeout_s


def test_the_waits_for_the_writer_are_timed_by_its_writes() -> None:
    policy = engine.Watchdog(min_timeout_s=2.0, factor=5.0, first_timeout_s=100.0, warmup=3)
    statistics = PhaseStatistics(policy)
    for _ in range(5):
        statistics.add(phases.WRITER, 0.0)  # waits that never waited teach nothing
    assert statistics.timeout(phases.WRITER, splits_done=400) == 100.0 and statistics.quantiles(phases.WRITER) is None
    for seconds in (1.0, 1.0, 4.0):
        statistics.add(WRITE, seconds)
    assert statistics.timeout(phases.WRITER, splits_done=400) == 20.0  # 5 x the p99 of the writes
    assert statistics.quantiles(phases.WRITER) == (1.0, 4.0)


def test_a_phase_marked_since_an_earlier_moment_counts_from_it() -> None:
    policy = engine.Watchdog(min_timeout_s=2.0, first_timeout_s=100.0, warmup=3)
    tracker = PhaseTracker(policy, words.new_buffer(), 0)
    began = time.monotonic() - 5.0
    tracker.mark(phases.WRITER, "the checkpoint writer thread", since=began)
    word = words.read(tracker.buffer)
    assert word is not None and word.phase == phases.WRITER
    assert word.started_ns == int(began * 1e9) and word.stalled_s(time.monotonic_ns()) >= 5.0
    tracker.mark(phases.WRITER, "the checkpoint writer thread", since=began)  # a polling wait: no change
    assert words.read(tracker.buffer) == word
    later = began + 4.0  # the write it waited for ended, the next one began
    tracker.mark(phases.WRITER, "the checkpoint writer thread", since=later)
    assert words.read(tracker.buffer).started_ns == int(later * 1e9)  # type: ignore[union-attr]


def test_a_wait_for_peers_is_a_collective_on_the_fit_thread_only() -> None:
    # The memory tier's peer copy: in it the rank waits in a collective (a peer that never answers
    # is blamed, engine.watchdog.verdict), then is back in its checkpoint. The same wait on a
    # writer thread leaves the phase of the thread the word follows alone (it flags the word while
    # it lasts: tests/watchdog/test_monitor.py).
    tracker = PhaseTracker(engine.Watchdog(min_timeout_s=2.0), words.new_buffer(), 0)
    tracker.mark(phases.CHECKPOINT, "a detail")
    trackers.install(tracker)
    try:
        with trackers.waiting_for_peers():
            assert words.read(tracker.buffer).phase == phases.COLLECTIVE  # type: ignore[union-attr]
        word = words.read(tracker.buffer)
        assert word is not None and (word.phase, word.detail) == (phases.CHECKPOINT, "a detail")
        seen: list[str] = []

        def writer() -> None:
            with trackers.waiting_for_peers():
                seen.append(words.read(tracker.buffer).phase)  # type: ignore[union-attr]

        thread = threading.Thread(target=writer)
        thread.start()
        thread.join()
        after = words.read(tracker.buffer)
        assert seen == [phases.CHECKPOINT] and after is not None
        assert (after.phase, after.detail, after.started_ns, after.flags) == (word.phase, word.detail, word.started_ns, 0)
    finally:
        trackers.install(None)
    with trackers.waiting_for_peers():  # no watchdog: nothing to mark
        pass


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(value) for value in range(1, 101)]
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile([], 0.99)) == (50.0, 99.0, 0.0)


def test_a_word_round_trips_and_a_torn_one_is_not_read() -> None:
    buffer = words.new_buffer()
    assert words.read(buffer) is None  # never written
    written = words.Word(7, 12, 123456789, 30.0, 0.5, 2.5, 0.125, 4242, 3, phases.CODE_OF[phases.WRITER], words.FINISHED,
                         "writer process 99")
    words.write(buffer, written)
    assert words.read(buffer) == written and written.phase == phases.WRITER
    buffer[0:8] = (8).to_bytes(8, "little")  # the first sequence number written, the last not yet
    assert words.read(buffer, attempts=3) is None
