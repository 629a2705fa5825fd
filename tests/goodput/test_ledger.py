"""The ledger's writing side: a torn last line (a kill mid-append) stays alone on its line, rows
on an object store are kept and written together, a storage failure is a warning."""

from __future__ import annotations

import pathlib

import pytest

from engine.checkpoint.store.storage import Storage
from engine.goodput import clock
from engine.goodput.ledger import Ledger
from engine.goodput.rows import parse, rank_file


def test_an_attempt_after_a_torn_row_starts_on_a_fresh_line(tmp_path: pathlib.Path) -> None:
    storage = Storage(str(tmp_path))
    first = Ledger(storage, 0, 1)
    first.started(clock.now())
    path = tmp_path / rank_file(0)
    path.write_bytes(path.read_bytes() + b'{"v":1,"attempt":"x","seq":0,"ev')  # killed mid-append
    second = Ledger(storage, 0, 1)
    second.started(clock.now())
    second.ended("finished", 0.0, 0)
    rows = parse(path.read_bytes())
    assert [(row["attempt"], row["event"]) for row in rows] == [
        (first.attempt, "start"), (second.attempt, "start"), (second.attempt, "end")]


def test_on_an_object_store_rows_wait_for_a_beat_or_a_phase_change() -> None:
    storage = Storage("memory://ledger-test")
    ledger = Ledger(storage, 3, 4, beat_s=3600.0)
    ledger.started(clock.now())
    ledger.commit(True, 0.5, 1, 0, 1, [(0, [5, 6])])
    assert [row["event"] for row in parse(storage.read(rank_file(3)))] == ["start"]
    ledger.ended("finished", 0.0, 1)
    rows = parse(storage.read(rank_file(3)))
    assert [row["event"] for row in rows] == ["start", "commit", "end"]
    assert rows[1]["ids"] == {"0": [[5, 2]]} and rows[0]["rank"] == 3 and rows[0]["world_size"] == 4


def test_a_save_that_committed_nothing_adds_its_stall_to_the_next_row(tmp_path: pathlib.Path) -> None:
    storage = Storage(str(tmp_path))
    ledger = Ledger(storage, 0, 1)
    ledger.started(clock.now())
    ledger.commit(False, 0.25, 1, 0, 1, [])
    ledger.commit(True, 0.5, 2, 0, 2, [])
    assert parse(storage.read(rank_file(0)))[-1]["blocking_s"] == pytest.approx(0.75)


def test_a_ledger_that_cannot_be_written_warns_and_the_run_goes_on(tmp_path: pathlib.Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    storage = Storage(str(tmp_path))
    ledger = Ledger(storage, 0, 1)
    ledger.started(clock.now())

    def full_disk(relative: str, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage, "append", full_disk)
    with pytest.warns(UserWarning, match="goodput ledger"):
        ledger.training()


def test_the_process_start_is_before_now_and_after_boot() -> None:
    wall, mono = clock.process_start()
    now = clock.now()
    assert wall <= now["wall"] and mono <= now["mono"] and mono >= 0
