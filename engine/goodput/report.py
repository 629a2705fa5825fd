"""The account as text: ``python -m engine goodput RUN_DIR`` and the goodput part of ``inspect``."""

from __future__ import annotations

from typing import Any

from engine.goodput.account import BUCKETS, CAUSES

_LABELS = {"productive": "productive training", "validation": "validation", "checkpoint_stall": "checkpoint stall",
           "startup": "start-up", "restore": "restore", "work_lost": "work lost (redone)",
           "hang_detection": "hang detection", "down": "down between attempts"}


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def lines(found: dict[str, Any]) -> list[str]:
    """The account (``Account.to_dict()``), one fact per line; the buckets add up to the wall time."""
    wall = found["wall_s"]
    ending = "" if found["ended"] else " (the last attempt wrote no end: running, or killed)"
    out = [f"goodput: {100 * found['goodput']:.1f}% of {duration(wall)} wall time{ending}"]
    for name in BUCKETS:
        seconds = found["buckets"][name]
        share = 100 * seconds / wall if wall > 0 else 0.0
        out.append(f"  {_LABELS[name]:<24}{duration(seconds):>12}  {share:5.1f}%")
    causes = ", ".join(f"{found['causes'][cause]} {cause}" for cause in CAUSES if found["causes"].get(cause))
    out.append(f"attempts: {found['attempts']} ({causes}); commits: {found['commits']}")
    mtbf = found["mtbf_s"]
    out.append(f"failures: {found['failures']}" + (f", mean time between failures {duration(mtbf)}" if mtbf else ""))
    samples = found["samples"]
    out.append(f"samples: {samples['trained']} trained, {samples['skipped']} skipped, {samples['seen_twice']} seen twice"
               + (f" (ids: {samples['ids']})" if samples["ids"] else ""))
    return out
