"""Stop conditions as pure functions of (progress counts, limits)."""

from __future__ import annotations


def epochs_done(completed_epochs: int, max_epochs: int | None) -> bool:
    """True once ``max_epochs`` epochs have completed."""
    return max_epochs is not None and completed_epochs >= max_epochs


def split_boundary_stop_reason(
    optimizer_steps: int, max_steps: int | None, elapsed_seconds: float, max_time: float | None
) -> str | None:
    """Why the run must stop at this split boundary, or None to go on."""
    if max_steps is not None and optimizer_steps >= max_steps:
        return f"max_steps={max_steps} reached"
    if max_time is not None and elapsed_seconds >= max_time:
        return f"max_time={max_time}s reached"
    return None
