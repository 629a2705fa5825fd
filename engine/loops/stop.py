"""Stop conditions as pure functions of (progress counts, limits)."""

from __future__ import annotations

from progress import RunEnd


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


def run_end(finish_reason: str | None, completed_epochs: int, max_epochs: int | None, max_steps: int | None,
            max_time: float | None) -> RunEnd | None:
    """How the run ended, if it did: the stop that finished it (a limit or a callback's
    request; a preemption is not an end), or ``max_epochs`` completed; None while it goes on."""
    reason = finish_reason
    if reason is None and epochs_done(completed_epochs, max_epochs):
        reason = f"max_epochs={max_epochs} reached"
    return None if reason is None else RunEnd(reason, max_epochs, max_steps, max_time)
