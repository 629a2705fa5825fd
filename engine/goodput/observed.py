"""What a run's ledger measured, as inputs to the model and to a checkpoint cadence: the failure
rate, a checkpoint's blocking time, the cost of a restart. A run whose checkpoint cadence weighs
failures (``CheckpointConfig(every_n_splits="auto", mtbf_seconds=...)``) starts with
:func:`observed_mtbf_seconds` (engine.run.run; the interval: Young/Daly,
:func:`engine.checkpoint.budget.young_daly_interval`)."""

from __future__ import annotations

import dataclasses

from engine.goodput.account import Account, account
from engine.goodput.rows import COMMIT, HANG, LedgerStorage
from engine.goodput.simulate import JobModel


@dataclasses.dataclass(frozen=True)
class ObservedCosts:
    """Means over the run's attempts, in seconds; None where the run has no instance yet."""

    failures_per_hour: float | None     # failures (exception, hang, killed) per hour of training
    checkpoint_s: float | None          # blocking time of one save
    interval_s: float | None            # productive training between two saves
    restart_s: float | None             # an attempt's start-up and restore
    down_s: float | None                # between an attempt's end and the next one's start
    hang_share: float                   # share of the failures that were hangs
    hang_detect_s: float | None         # a hang's detection time
    world_size: int


def observed_costs(storage: LedgerStorage) -> ObservedCosts | None:
    """The costs measured in the run dir ``storage`` (None: it has no ledger)."""
    found = account(storage)
    return None if found is None else costs_of(found)


def observed_mtbf_seconds(storage: LedgerStorage) -> float | None:
    """The training time per failure the run dir's ledger observed (None: no ledger, or no
    failure seen yet): what ``CheckpointConfig(mtbf_seconds=...)`` weighs once it is known."""
    found = account(storage)
    return None if found is None else found.training_mtbf_s


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def costs_of(found: Account) -> ObservedCosts:
    attempts = found.attempts
    commits = [float(row.get("blocking_s", 0.0)) for attempt in attempts for _, row in attempt.rows
               if row.get("event") == COMMIT]
    hangs = [attempt.hang_s for attempt in attempts if attempt.cause == HANG]
    mtbf = found.training_mtbf_s
    return ObservedCosts(
        failures_per_hour=None if mtbf is None else 3600.0 / mtbf,
        checkpoint_s=_mean(commits),
        interval_s=found.buckets["productive"] / len(commits) if commits else None,
        restart_s=_mean([attempt.buckets["startup"] + attempt.buckets["restore"] for attempt in attempts]),
        down_s=_mean([attempt.buckets["down"] for attempt in attempts[:-1]]),
        hang_share=len(hangs) / found.failures if found.failures else 0.0,
        hang_detect_s=_mean(hangs),
        world_size=attempts[0].world_size if attempts else 1)


def model_of(costs: ObservedCosts, gpus: int | None = None, mtbf_gpu_hours: float | None = None) -> JobModel:
    """A model with the run's measured costs; ``gpus`` and ``mtbf_gpu_hours`` default to the
    run's own (its world size, and its failure rate spread over it)."""
    gpus = gpus if gpus is not None else costs.world_size
    if mtbf_gpu_hours is None:
        if not costs.failures_per_hour:
            raise ValueError("the run saw no failure: give --mtbf-gpu-hours")
        mtbf_gpu_hours = costs.world_size / costs.failures_per_hour
    return JobModel(gpus=gpus, mtbf_gpu_hours=mtbf_gpu_hours, checkpoint_s=costs.checkpoint_s or 0.0,
                    restart_s=costs.restart_s or 0.0, hang_share=costs.hang_share,
                    hang_detect_s=costs.hang_detect_s or 0.0, down_s=costs.down_s or 0.0)
