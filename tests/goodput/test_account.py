"""The account of hand-written ledgers: each expected bucket is worked out from the instants the
test chose. A killed attempt is inferred from its missing end, a hang from hangs.jsonl; a torn
or doubled row changes nothing."""

from __future__ import annotations

import json
import pathlib

import pytest

from engine.checkpoint.store.storage import Storage
from engine.goodput.account import account
from ledger_rows import BASE, AttemptWriter, write


def two_attempts() -> tuple[AttemptWriter, AttemptWriter]:
    # Attempt 1: process start 0, restore 2..3, training from 4; commits at 6 (0.5 s blocking, units 2)
    # and 8 (0.5 s, units 4); a beat at 9; killed. Attempt 2 starts at 20, resumes from units 4.
    first = AttemptWriter("a1", process_start=0.0).start(2.0).restored(3.0).row("training", 4.0)
    first.commit(6.0, 2, 0.5, {"0": [[0, 4]]}).commit(8.0, 4, 0.5, {"0": [[4, 4]]}).row("beat", 9.0, units=5)
    second = AttemptWriter("a2", process_start=20.0).start(21.0).restored(22.0, units=4).row("training", 22.5)
    second.commit(24.0, 6, 0.5, {"0": [[8, 4]]}, epochs=1).end(25.0, "finished", flush_s=0.25)
    return first, second


def test_the_buckets_of_a_killed_then_finished_run(tmp_path: pathlib.Path) -> None:
    write(tmp_path, *two_attempts())
    found = account(Storage(str(tmp_path)))
    assert found is not None
    # Attempt 1 is placed dead at its last row (9) + one beat (1) + one unit: 5 units in 5 s -> 11.
    expected = {
        "startup": (2 - 0) + (4 - 3) + (21 - 20) + (22.5 - 22),
        "restore": (3 - 2) + (22 - 21),
        "checkpoint_stall": 0.5 + 0.5 + 0.5 + 0.25,
        "validation": 0.0,
        "productive": (8 - 4 - 1.0) + (25 - 22.5 - 0.5 - 0.25),
        "work_lost": 11 - 8,
        "hang_detection": 0.0,
        "down": 20 - 11,
    }
    assert found.buckets == pytest.approx(expected)
    assert found.wall_s == pytest.approx(25.0)
    assert sum(found.buckets.values()) == pytest.approx(found.wall_s)
    assert found.causes == {"killed": 1, "finished": 1}
    assert found.mtbf_s == pytest.approx((11 - 0) + (25 - 20))
    assert (found.samples.trained, found.samples.skipped, found.samples.seen_twice) == (12, 0, 0)


def test_work_committed_after_the_checkpoint_the_next_attempt_resumed_from_is_lost(tmp_path: pathlib.Path) -> None:
    first, second = two_attempts()
    second.rows[1]["units"] = 2  # the newest checkpoint (units 4) was torn: the next attempt resumed from units 2
    write(tmp_path, first, second)
    found = account(Storage(str(tmp_path)))
    assert found is not None
    assert found.buckets["work_lost"] == pytest.approx(11 - 6 - 0.5)  # the commit at 8 blocked 0.5 s of it
    assert found.buckets["productive"] == pytest.approx((6 - 4 - 0.5) + (25 - 22.5 - 0.5 - 0.25))
    # Samples 4..7 were committed at units 4 only, which was lost: never trained as far as the run knows.
    assert (found.samples.trained, found.samples.skipped) == (8, 4)


def test_a_hang_is_read_from_hangs_jsonl(tmp_path: pathlib.Path) -> None:
    first, second = two_attempts()
    write(tmp_path, first, second)
    # Reported at 15 after 4 s without progress: hung from 11, detected at 15, then down until 20.
    (tmp_path / "hangs.jsonl").write_text(json.dumps({"time": BASE + 15.0, "stalled_s": 4.0}) + "\n")
    found = account(Storage(str(tmp_path)))
    assert found is not None
    assert found.causes == {"hang": 1, "finished": 1}
    assert found.buckets["hang_detection"] == pytest.approx(4.0)
    assert found.buckets["work_lost"] == pytest.approx(15 - 8 - 4.0)
    assert found.buckets["down"] == pytest.approx(20 - 15)
    assert sum(found.buckets.values()) == pytest.approx(25.0)


def test_a_hung_writer_abandoned_while_training_went_on_ends_no_attempt(tmp_path: pathlib.Path) -> None:
    first, second = two_attempts()
    write(tmp_path, first, second)
    # The first attempt was killed at 11; a writer abandoned at 10 (on_io_error="warn") is no hang of it.
    (tmp_path / "hangs.jsonl").write_text(json.dumps({"time": BASE + 10.0, "stalled_s": 4.0, "exit_code": None,
                                                      "action": "a new writer thread takes over"}) + "\n")
    found = account(Storage(str(tmp_path)))
    assert found is not None
    assert found.causes == {"killed": 1, "finished": 1} and found.buckets["hang_detection"] == 0.0


def test_seen_twice_and_skipped_are_counted_per_epoch(tmp_path: pathlib.Path) -> None:
    attempt = AttemptWriter("a1", process_start=0.0).start(1.0).restored(2.0).row("training", 3.0)
    attempt.commit(4.0, 1, 0.1, {"0": [[0, 4], [2, 2]]})          # ids 2 and 3 twice in epoch 0
    attempt.commit(5.0, 2, 0.1, {"0": [[8, 2]], "1": [[0, 12]]}, epochs=1)  # ids 6, 7 never in epoch 0
    attempt.end(6.0, "finished")
    write(tmp_path, attempt)
    found = account(Storage(str(tmp_path)))
    assert found is not None
    assert (found.samples.trained, found.samples.skipped, found.samples.seen_twice) == (6 + 2 + 12, 6, 2)


def test_a_torn_last_line_and_a_doubled_row_are_read_once(tmp_path: pathlib.Path) -> None:
    first, second = two_attempts()
    second.rows.insert(4, dict(second.rows[3]))  # a row written twice (same attempt and seq)
    write(tmp_path, first, second, tail='{"v": 1, "attempt": "a3", "se')
    found = account(Storage(str(tmp_path)))
    assert found is not None and len(found.attempts) == 2 and found.commits == 3
    assert found.wall_s == pytest.approx(25.0)


def test_a_run_without_a_ledger_has_no_account(tmp_path: pathlib.Path) -> None:
    assert account(Storage(str(tmp_path))) is None
