"""metrics.jsonl: buffered rows, the committed length a checkpoint records, and truncation on resume."""

import json

import pytest

from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.metrics_log import METRICS_FILE, MetricsLog
from progress import Cursor


@pytest.fixture
def storage(tmp_path):
    return Storage(str(tmp_path / "run"))


def rows(storage):
    return [json.loads(line) for line in bytes(storage.read(METRICS_FILE)).decode().splitlines()]


def test_rows_are_buffered_until_flush_and_the_length_is_known_before(storage):
    log = MetricsLog(storage)
    log.start_fresh()
    log.append(Cursor(0, 0, 0, 0), [1.5], 1)
    log.append(Cursor(0, 0, 1, 0), [0.5, 0.25], 2)
    assert storage.size(METRICS_FILE) == 0
    expected = log.length_after_flush()
    assert log.flush() == expected == storage.size(METRICS_FILE)
    assert rows(storage) == [
        {"stage": "train", "epoch": 0, "batch": 0, "split": 0, "loss": 1.5, "step": 1},
        {"stage": "train", "epoch": 0, "batch": 0, "split": 1, "loss": 0.75, "step": 2, "losses": [0.5, 0.25]},
    ]


def test_resume_cuts_rows_written_after_the_checkpoint(storage):
    log = MetricsLog(storage)
    log.start_fresh()
    log.append(Cursor(0, 0, 0, 0), [1.0], 1)
    committed = log.flush()
    log.append(Cursor(0, 0, 1, 0), [2.0], 2)
    log.flush()
    resumed = MetricsLog(storage)
    resumed.resume_at(committed)
    assert storage.size(METRICS_FILE) == committed
    assert [row["split"] for row in rows(storage)] == [0]


def test_resume_warns_when_committed_rows_are_missing(storage):
    log = MetricsLog(storage)
    log.start_fresh()
    with pytest.warns(UserWarning, match="missing"):
        log.resume_at(100)
    assert log.committed_bytes == 0


def test_a_fresh_start_replaces_an_old_file_with_a_warning(storage):
    log = MetricsLog(storage)
    log.start_fresh()
    log.append(Cursor(0, 0, 0, 0), [1.0], 1)
    log.flush()
    with pytest.warns(UserWarning, match="replaced"):
        MetricsLog(storage).start_fresh()
    assert storage.size(METRICS_FILE) == 0


def test_without_storage_nothing_is_written():
    log = MetricsLog(None)
    log.start_fresh()
    log.append(Cursor(0, 0, 0, 0), [1.0], 1)
    assert log.flush() == 0
