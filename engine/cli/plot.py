"""``python -m engine plot DIR [--out FILE.png]``: training loss per split and validation metrics
over optimizer steps, with a vertical marker where the run resumed. Needs matplotlib
(``pip install 'splitloop[plot]'``); draws off-screen (no display needed)."""

from __future__ import annotations

import json
from typing import Any

from engine.checkpoint.storage import Storage
from engine.errors import CheckpointNotFound, ConfigError, EngineError
from engine.run.metrics_log import METRICS_FILE, RESUMES_FILE


class PlotUnavailable(EngineError):
    """matplotlib is not installed."""


def read_rows(storage: Storage, file_name: str) -> list[dict[str, Any]]:
    """The JSON rows of a run file (a torn last line, from a killed writer, is ignored)."""
    if not storage.exists(file_name):
        return []
    rows = []
    for line in bytes(storage.read(file_name)).decode("utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def plot_run(run_dir: str, out: str) -> dict[str, int]:
    """Render the run's curves into the PNG file ``out``; returns what was drawn (row counts)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError as error:
        raise PlotUnavailable("plotting needs matplotlib: pip install 'splitloop[plot]'") from error
    storage = Storage(run_dir, create=False)
    if not storage.exists(METRICS_FILE):
        raise CheckpointNotFound(f"{run_dir} has no {METRICS_FILE}: is it a run directory?")
    rows = read_rows(storage, METRICS_FILE)
    # Rows of another shape (a hand-edited or foreign file) are skipped, like torn lines.
    train = [row for row in rows if row.get("stage", "train") == "train" and _is_number(row.get("step"))
             and _is_number(row.get("loss"))]
    val = [row for row in rows if row.get("stage") == "val" and _is_number(row.get("step"))
           and isinstance(row.get("metrics"), dict) and all(map(_is_number, row["metrics"].values()))]
    resumes = [row for row in read_rows(storage, RESUMES_FILE) if _is_number(row.get("step", 0))]
    if not train:
        raise ConfigError(f"{run_dir}/{METRICS_FILE} holds no training row to plot")
    figure, axes = pyplot.subplots(2 if val else 1, 1, figsize=(9, 7 if val else 4), sharex=True, squeeze=False)
    loss_axes = axes[0][0]
    loss_axes.plot([row["step"] for row in train], [row["loss"] for row in train], linewidth=0.8, label="train loss (per split)")
    loss_axes.set_ylabel("loss")
    loss_axes.legend(loc="upper right")
    if val:
        val_axes = axes[1][0]
        for name in sorted({name for row in val for name in row.get("metrics", {})}):
            points = [(row["step"], row["metrics"][name]) for row in val if name in row.get("metrics", {})]
            val_axes.plot(*zip(*points), marker="o", markersize=3, label=name)
        val_axes.set_ylabel("validation")
        val_axes.legend(loc="upper right")
    for row in resumes:
        for column in axes:
            column[0].axvline(row.get("step", 0), color="grey", linestyle="--", linewidth=0.8)
    axes[-1][0].set_xlabel("optimizer steps" + (" (dashed: resumed)" if resumes else ""))
    figure.suptitle(run_dir)
    figure.tight_layout()
    figure.savefig(out, format="png", dpi=100)
    pyplot.close(figure)
    return {"train": len(train), "val": len(val), "resumes": len(resumes)}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
