"""Logger.committed: a logger learns, after each checkpoint commit, how many rows of metrics.jsonl
no resume will take back (what the trackers send); without checkpoints every row as it is logged."""

from __future__ import annotations

import json

import engine
import engine.loggers
from plateau_scenario import train_plateau
from resume_helpers import read_metrics


class Recording(engine.loggers.Logger):
    """Records, at each committed(count), how many rows it had received by then."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.commits: list[tuple[int, int]] = []  # (count committed, rows received by then)

    def log_row(self, row):
        self.rows.append(row)

    def committed(self, rows):
        self.commits.append((rows, len(self.rows)))


def test_each_commit_tells_the_loggers_how_many_rows_it_committed(tmp_path):
    logger = Recording()
    train_plateau(str(tmp_path), loggers=[logger], checkpoint=engine.CheckpointConfig(every_n_splits=4, keep_last=2))
    rows = [json.loads(line) for line in read_metrics(str(tmp_path)).splitlines()]
    counts = [count for count, _ in logger.commits]
    assert logger.rows == rows and counts == sorted(set(counts)) and counts[-1] == len(rows)
    assert all(count <= received for count, received in logger.commits)
    # A checkpoint every 4 splits commits rows in steps, not one by one.
    assert len(counts) < len(rows) / 2


def test_without_checkpoints_every_row_is_committed_as_it_is_logged(tmp_path):
    logger = Recording()
    train_plateau(None, loggers=[logger])
    assert logger.commits == [(count, count) for count in range(1, len(logger.rows) + 1)]
