"""``python -m engine plot DIR [--out FILE.png]``: a run's curves over optimizer steps, one panel
per metric family, with a labelled marker where the run resumed. Needs matplotlib
(``pip install 'splitloop[plot]'``); draws off-screen (no display needed). A rollback past a
numerical anomaly (``anomalies.jsonl``) is a red dotted line where it happened, a hang the
watchdog reported (``hangs.jsonl``) a purple dash-dotted line at the last split the hung rank
completed.

A *family* is a metric name without its stage prefix: ``loss`` holds the training loss of every
split, ``val_loss`` and ``train_loss``; ``ppl`` holds ``val_ppl``; ``acc`` holds ``train_acc``
and ``val_acc``. So values of one kind share an axis and values of different kinds (a perplexity
of 280 and a loss of 2.1) never do. Per-split training values are drawn faint, raw, under a
moving mean over whole batches (with TBPTT a batch's first split, which starts from no hidden
state, has a higher loss than its last: the raw curve zig-zags with the batch).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterable

from engine.checkpoint.store.storage import Storage
from engine.errors import CheckpointNotFound, ConfigError, EngineError
from engine.checkpoint.store.metrics_log import METRICS_FILE, RESUMES_FILE
from engine.run.rollback import ANOMALIES_FILE
from engine.watchdog.report import read_hangs

_STAGE_PREFIXES = ("train_", "val_", "validation_", "test_")
TRAINING_LOSS = "loss"  # the name of the per-split training loss in its panel
# About this many points of the smoothed curve per panel width: fewer hide nothing of the trend.
_SMOOTHED_POINTS = 60
# A panel whose positive values span more than this factor gets a logarithmic axis.
_LOG_SCALE_SPAN = 20.0

Points = list[tuple[float, float]]


class PlotUnavailable(EngineError):
    """matplotlib is not installed."""


@dataclasses.dataclass
class Curves:
    """What a run directory holds to draw, by metric name: per-split training values (the loss
    and what ``training_step`` logged), epoch aggregates, validation values; and the resumes."""

    splits: dict[str, Points]
    epochs: dict[str, Points]
    validation: dict[str, Points]
    resumes: list[tuple[float, str]]
    anomalies: list[tuple[float, str]]  # (optimizer steps, what happened): rollbacks past an anomaly
    hangs: list[tuple[float, str]]  # (optimizer steps, who hung where): hangs.jsonl rows
    split_period: int  # splits per batch (1 without TBPTT): the smoothing window is a multiple
    rows: dict[str, int]  # rows drawn, per kind ("train", "val", "resumes")
    # (kind, start, end) in seconds since the first attempt's start: productive / lost / down (engine.goodput)
    timeline: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)

    def families(self) -> list[str]:
        """The panels, the training loss's first."""
        names = [*self.splits, *self.epochs, *self.validation]
        others = sorted({family_of(name) for name in names} - {TRAINING_LOSS})
        return [TRAINING_LOSS, *others]


def family_of(name: str) -> str:
    """``val_ppl`` -> ``ppl``: the name without a stage prefix."""
    for prefix in _STAGE_PREFIXES:
        if name.startswith(prefix) and len(name) > len(prefix):
            return name[len(prefix):]
    return name


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


def read_curves(run_dir: str) -> Curves:
    """The curves of ``run_dir``; rows of another shape (a hand-edited or foreign file) are
    skipped, like torn lines."""
    storage = Storage(run_dir, create=False)
    if not storage.exists(METRICS_FILE):
        raise CheckpointNotFound(f"{run_dir} has no {METRICS_FILE}: is it a run directory?")
    rows = read_rows(storage, METRICS_FILE)
    train = [row for row in rows if row.get("stage", "train") == "train" and _is_number(row.get("step"))
             and _is_number(row.get("loss"))]
    if not train:
        raise ConfigError(f"{run_dir}/{METRICS_FILE} holds no training row to plot")
    val = _aggregate_rows(rows, "val")
    resumes = [(float(row.get("step", 0)), str(row.get("checkpoint", "?")))
               for row in read_rows(storage, RESUMES_FILE) if _is_number(row.get("step", 0))]
    splits: dict[str, Points] = {TRAINING_LOSS: [(row["step"], row["loss"]) for row in train]}
    for row in train:
        for name, value in _numbers(row.get("metrics")):
            splits.setdefault(name, []).append((row["step"], value))
    period = max((row["split"] for row in train if isinstance(row.get("split"), int)), default=0) + 1
    anomalies = [(float(row["step"]), f"{row.get('kind', 'anomaly')}: back to {_short(str(row.get('rolled_back_to', '?')))}")
                 for row in read_rows(storage, ANOMALIES_FILE) if _is_number(row.get("step"))]
    hangs = _hangs(storage, train)
    timeline = _timeline(storage)
    return Curves(splits=splits, epochs=_by_name(_aggregate_rows(rows, "train_epoch")), validation=_by_name(val),
                  resumes=resumes, anomalies=anomalies, hangs=hangs, split_period=period,
                  rows={"train": len(train), "val": len(val), "resumes": len(resumes), "anomalies": len(anomalies),
                        "hangs": len(hangs)},
                  timeline=timeline)


def _timeline(storage: Storage) -> list[tuple[str, float, float]]:
    """The attempts' productive, lost and down segments from the goodput ledger ([] without one)."""
    from engine.goodput.account import account, timeline_segments
    found = account(storage)
    if found is None:
        return []
    origin = found.attempts[0].process_start
    return [(kind, start - origin, end - origin) for kind, start, end in timeline_segments(found.attempts)]


def _hangs(storage: Storage, train: list[dict[str, Any]]) -> list[tuple[float, str]]:
    """Each hang at the step of the last split its rank completed (the training rows are one per
    split, in order); a row that names no split (every rank of a node waited for another node) is
    left out."""
    found = []
    for row in read_hangs(storage):
        split = row.get("last_split")
        if not isinstance(split, int) or isinstance(split, bool) or split < 0:
            continue
        step = float(train[min(split, len(train)) - 1]["step"]) if split > 0 else 0.0
        found.append((step, f"hang: rank {row.get('rank')} in {row.get('phase', '?')} after split {split}"))
    return found


def plot_run(run_dir: str, out: str) -> dict[str, int]:
    """Render the run's curves into the PNG file ``out``; returns what was drawn (row counts)."""
    pyplot = _pyplot()
    curves = read_curves(run_dir)
    figure = draw(curves, pyplot, run_dir)
    figure.savefig(out, format="png", dpi=100)
    pyplot.close(figure)
    return curves.rows


def draw(curves: Curves, pyplot: Any, title: str) -> Any:
    """The figure: one panel per family, stacked over a shared step axis, resumes marked."""
    families = curves.families()
    rows = len(families) + (1 if curves.timeline else 0)
    figure, axes = pyplot.subplots(rows, 1, figsize=(12, 1.5 + 2.6 * rows), squeeze=False)
    panels = [row[0] for row in axes[:len(families)]]
    for panel in panels[1:]:
        panel.sharex(panels[0])
    if curves.timeline:
        _draw_timeline(axes[-1][0], curves.timeline)
    for family, panel in zip(families, panels):
        _draw_family(panel, family, curves)
    _mark_resumes(panels, curves.resumes)
    _mark_anomalies(panels, curves.anomalies)
    _mark_hangs(panels, curves.hangs)
    panels[-1].set_xlabel("optimizer steps")
    figure.suptitle(title)
    figure.tight_layout()
    return figure


_TIMELINE_COLOURS = {"start-up": "tab:blue", "productive": "tab:green", "lost": "tab:red", "down": "lightgrey"}


def _draw_timeline(panel: Any, timeline: list[tuple[str, float, float]]) -> None:
    """The attempts over wall time: each one's start-up, kept (productive) and lost time, and the
    down time between them (engine.goodput; docs/goodput.md)."""
    for kind, colour in _TIMELINE_COLOURS.items():
        spans = [(start, end - start) for found, start, end in timeline if found == kind and end > start]
        if spans:
            panel.broken_barh(spans, (0, 1), color=colour, label=kind)
    panel.set_yticks([])
    panel.set_xlabel("seconds since the first attempt started")
    panel.set_title("attempts (python -m engine goodput)", fontsize="small")
    _legend(panel)


def _draw_family(panel: Any, family: str, curves: Curves) -> None:
    window = _smoothing_window(len(curves.splits[TRAINING_LOSS]), curves.split_period)
    for name in sorted(curves.splits, key=lambda name: name != TRAINING_LOSS):
        if family_of(name) == family:
            label = "train loss" if name == TRAINING_LOSS else name
            raw = panel.plot(*zip(*curves.splits[name]), linewidth=0.6, alpha=0.3, label=f"{label} (per split)")
            panel.plot(*zip(*_moving_mean(curves.splits[name], window)), linewidth=1.8, color=raw[0].get_color(),
                       label=f"{label} (mean of {window} splits)")
    for name, points in curves.epochs.items():
        if family_of(name) == family:
            panel.plot(*zip(*points), marker="s", markersize=4, linestyle="--", label=f"{name} (epoch)")
    for name, points in curves.validation.items():
        if family_of(name) == family:
            panel.plot(*zip(*points), marker="o", markersize=3, label=name)
    values = [value for line in panel.get_lines() for value in line.get_ydata() if math.isfinite(value)]
    if values and min(values) > 0 and max(values) / min(values) > _LOG_SCALE_SPAN:
        panel.set_yscale("log")
    panel.set_ylabel(family)
    panel.grid(alpha=0.3)
    _legend(panel)


def _mark_resumes(panels: list[Any], resumes: list[tuple[float, str]]) -> None:
    """A dashed line at each step where the run resumed, labelled on the top panel with the
    checkpoint and how many times (several resumes from one checkpoint share a line)."""
    by_step: dict[float, list[str]] = {}
    for step, checkpoint in resumes:
        by_step.setdefault(step, []).append(checkpoint)
    top = panels[0]
    left, right = top.get_xlim()
    for number, (step, checkpoints) in enumerate(sorted(by_step.items())):
        for panel in panels:
            panel.axvline(step, color="grey", linestyle="--", linewidth=0.8,
                          label="resumed" if panel is top and number == 0 else None)
        names = sorted(set(checkpoints))
        label = f"resumed from {', '.join(_short(name) for name in names)}"
        if len(checkpoints) > 1:
            label += f" ({len(checkpoints)} times)"
        on_the_left = step > (left + right) / 2  # the label stays inside the panel at either end
        top.annotate(label, xy=(step, 1.0), xycoords=("data", "axes fraction"), xytext=(-2 if on_the_left else 2, -4),
                     textcoords="offset points", rotation=90, va="top", ha="right" if on_the_left else "left",
                     fontsize="x-small", color="dimgrey")
    if by_step:
        _legend(top)


def _mark_anomalies(panels: list[Any], anomalies: list[tuple[float, str]]) -> None:
    """A red dotted line at each anomaly the run rolled back past, labelled on the top panel."""
    _mark_events(panels, anomalies, "red", ":", "rolled back (anomaly)", at=0.0, va="bottom", offset=(2, 4))


def _mark_hangs(panels: list[Any], hangs: list[tuple[float, str]]) -> None:
    """A purple dash-dotted line at each hang, labelled on the top panel."""
    _mark_events(panels, hangs, "purple", "-.", "hang (watchdog)", at=0.5, va="center", offset=(2, 0))


def _mark_events(panels: list[Any], events: list[tuple[float, str]], colour: str, linestyle: str, legend: str,
                 at: float, va: str, offset: tuple[int, int]) -> None:
    """A vertical line on every panel at each event's step; the event's label written up the top
    panel from height ``at`` (a fraction of the panel), the legend there once."""
    top = panels[0]
    for number, (step, label) in enumerate(events):
        for panel in panels:
            panel.axvline(step, color=colour, linestyle=linestyle, linewidth=1.0,
                          label=legend if panel is top and number == 0 else None)
        top.annotate(label, xy=(step, at), xycoords=("data", "axes fraction"), xytext=offset,
                     textcoords="offset points", rotation=90, va=va, ha="left", fontsize="x-small", color=colour)
    if events:
        _legend(top)


def _legend(panel: Any) -> None:
    """Beside the panel, where it hides no curve and no resume label."""
    panel.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0.0)


def _short(checkpoint: str) -> str:
    """``ckpt-0000000016`` -> ``ckpt-16``."""
    prefix, _, number = checkpoint.partition("-")
    return f"{prefix}-{int(number)}" if number.isdigit() else checkpoint


def _smoothing_window(count: int, period: int) -> int:
    """Whole batches (a multiple of the splits per batch, so TBPTT's zig-zag cancels), about
    ``count / _SMOOTHED_POINTS`` splits."""
    return period * max(1, math.ceil(count / (_SMOOTHED_POINTS * period)))


def _moving_mean(points: Points, window: int) -> Points:
    """The mean of each run of ``window`` consecutive points, placed at the middle of its steps
    (a trailing mean would lag behind a falling loss)."""
    window = min(window, len(points))
    steps = [step for step, _ in points]
    values = [value for _, value in points]
    step_total, total = sum(steps[:window]), sum(values[:window])
    smoothed = [(step_total / window, total / window)]
    for index in range(window, len(points)):
        step_total += steps[index] - steps[index - window]
        total += values[index] - values[index - window]
        smoothed.append((step_total / window, total / window))
    return smoothed


def _aggregate_rows(rows: list[dict[str, Any]], stage: str) -> list[dict[str, Any]]:
    return [row for row in rows if row.get("stage") == stage and _is_number(row.get("step"))
            and isinstance(row.get("metrics"), dict) and all(map(_is_number, row["metrics"].values()))]


def _by_name(rows: list[dict[str, Any]]) -> dict[str, Points]:
    series: dict[str, Points] = {}
    for row in rows:
        for name, value in _numbers(row["metrics"]):
            series.setdefault(name, []).append((row["step"], value))
    return series


def _numbers(metrics: Any) -> Iterable[tuple[str, float]]:
    if isinstance(metrics, dict):
        return [(str(name), value) for name, value in metrics.items() if _is_number(value)]
    return []


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError as error:
        raise PlotUnavailable("plotting needs matplotlib: pip install 'splitloop[plot]'") from error
    return pyplot


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
