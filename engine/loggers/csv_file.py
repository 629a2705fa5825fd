"""``engine.loggers.CSV``: the rows of metrics.jsonl as a CSV table.

One line per row of metrics.jsonl, columns ``stage, epoch, batch, split, step, loss, losses``
then one per metric name in the order the names first appear (a name that is also one of those
columns is written ``metrics.<name>``); a cell is empty where the row has no such value. When a
new name appears the file is rewritten with the wider header. Floats are written as Python's
``repr``, which reads back to the same float.

Resume: the file is rebuilt from the rows the resumed checkpoint committed to metrics.jsonl (what
the interrupted process wrote after it is dropped, as metrics.jsonl is cut back), so the CSV of a
run interrupted any number of times is byte for byte the CSV of a run that was not. The rebuild
is written to a temporary file beside it and renamed over it.
"""

from __future__ import annotations

import csv
import json
import os
from typing import IO, Iterable, Sequence

from engine.loggers.base import Logger, Row, local_path, refuse_existing

ROW_COLUMNS = ("stage", "epoch", "batch", "split", "step", "loss", "losses")


class CSV(Logger):
    """Write the run's metrics rows to the CSV file ``path`` (its directory created if needed)::

        config = engine.TrainerConfig(run_dir="runs/a", loggers=[engine.loggers.CSV("runs/a/metrics.csv")])
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = local_path("CSV", "path", path)
        refuse_existing("CSV", "path", self.path, must_be_directory=False)
        self._columns: list[str] = list(ROW_COLUMNS)
        self._file: IO[str] | None = None

    def __repr__(self) -> str:
        return f"engine.loggers.CSV({self.path!r})"

    def start_fresh(self) -> None:
        self._rewrite([])

    def resume(self, committed_rows: Sequence[Row], resumed_step: int) -> None:
        self._rewrite([_cells(row) for row in committed_rows])

    def log_row(self, row: Row) -> None:
        if self._file is None:
            return
        cells = _cells(row)
        if any(column not in self._columns for column in cells):
            self._rewrite(self._read_back() + [cells])
            return
        csv.DictWriter(self._file, self._columns).writerow(cells)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            file.close()

    def _read_back(self) -> list[dict[str, object]]:
        self.close()
        with open(self.path, newline="") as file:
            return [dict(line) for line in csv.DictReader(file)]

    def _rewrite(self, rows: list[dict[str, object]]) -> None:
        """Replace the file with ``rows`` under the columns they need, and keep it open to append."""
        self.close()
        self._columns = _columns_of(rows)
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        temporary = f"{self.path}.tmp-{os.getpid()}"
        with open(temporary, "w", newline="") as file:
            writer = csv.DictWriter(file, self._columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(temporary, self.path)
        self._file = open(self.path, "a", newline="")


def _cells(row: Row) -> dict[str, object]:
    """A row of metrics.jsonl as CSV cells (``losses`` as its JSON list)."""
    cells: dict[str, object] = {}
    for column in ROW_COLUMNS:
        if column in row:
            value = row[column]
            cells[column] = json.dumps(value) if isinstance(value, list) else value
    metrics = row.get("metrics")
    if isinstance(metrics, dict):
        for name, value in metrics.items():
            cells[f"metrics.{name}" if name in ROW_COLUMNS else str(name)] = value
    return cells


def _columns_of(rows: Iterable[dict[str, object]]) -> list[str]:
    columns = list(ROW_COLUMNS)
    for row in rows:
        columns += [column for column in row if column not in columns]
    return columns
