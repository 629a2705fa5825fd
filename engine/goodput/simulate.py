"""A Monte-Carlo model of a large job's goodput (docs/goodput.md has the model and its sources).

Pure Python, no torch. A job of ``gpus`` GPUs fails as a Poisson process of rate
``gpus / mtbf_gpu_hours`` over its training time (any GPU's failure stops the whole synchronous
job; a restart is not struck: its failures are part of what a restart costs). The job trains
``interval_s`` of productive time, then blocks ``checkpoint_s`` to save, again and again. A
failure loses the training since the last completed save; a share ``hang_share`` of failures is
a hang, caught only after ``hang_detect_s``; every restart waits ``down_s``, a share
``node_share`` also ``requeue_s`` for another node, then pays ``restart_s`` (process start to the
first split: start-up and restore) before training again. The first start pays ``restart_s``. Each trial runs ``horizon_s`` of wall time;
the buckets are averaged over ``trials`` trials drawn from one seeded generator (the same
failure times for every interval compared: common random numbers).
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Iterable, Sequence

from engine.checkpoint.budget import young_daly_interval

SIMULATED_BUCKETS = ("productive", "checkpoint_stall", "startup", "work_lost", "hang_detection", "down")


@dataclasses.dataclass(frozen=True)
class JobModel:
    """The job and its costs, in seconds (see the module docstring)."""

    gpus: int
    mtbf_gpu_hours: float
    checkpoint_s: float
    restart_s: float
    hang_share: float = 0.0
    hang_detect_s: float = 0.0
    node_share: float = 0.0
    requeue_s: float = 0.0
    down_s: float = 0.0           # every restart waits this long before the process starts (a relauncher's delay)

    @property
    def job_mtbf_s(self) -> float:
        return self.mtbf_gpu_hours * 3600.0 / self.gpus


@dataclasses.dataclass(frozen=True)
class Profile:
    """Labelled costs from a published figure (docs/goodput.md cites each)."""

    name: str
    checkpoint_s: float
    source: str


# The blocking time of one checkpoint, as published (docs/goodput.md, "Anchors").
PROFILES = {
    "sync-dcp-7b": Profile("sync-dcp-7b", 148.8, "PyTorch blog 2024-06-12, 7B model, synchronous DCP save"),
    "async-dcp-7b": Profile("async-dcp-7b", 6.3, "PyTorch blog 2024-06-12, 7B model, DCP async_save"),
    "async-dcp-70b-cached": Profile("async-dcp-70b-cached", 0.78,
                                    "PyTorch blog 2025-04-30, Llama3-70B on 1856 H200, process-based async DCP, cached plans"),
}
# Llama 3 (arXiv:2407.21783, section 3.3.4): 419 unexpected interruptions in 54 days on 16,384 GPUs.
LLAMA3_MTBF_GPU_HOURS = 54 * 24 * 16384 / 419


@dataclasses.dataclass(frozen=True)
class Outcome:
    """Mean seconds per bucket over the trials, and the goodput they give."""

    interval_s: float
    buckets: dict[str, float]
    horizon_s: float
    failures: float

    @property
    def goodput(self) -> float:
        return self.buckets["productive"] / self.horizon_s


def simulate(model: JobModel, interval_s: float, horizon_s: float, trials: int = 200, seed: int = 0) -> Outcome:
    """Run ``trials`` trials of ``horizon_s`` wall seconds with a save after every ``interval_s``
    of training (0: never save)."""
    generator = random.Random(seed)
    totals = dict.fromkeys(SIMULATED_BUCKETS, 0.0)
    failures = 0
    rate = 1.0 / model.job_mtbf_s
    for _ in range(trials):
        buckets, count = _trial(model, interval_s, horizon_s, rate, generator)
        failures += count
        for name, seconds in buckets.items():
            totals[name] += seconds
    return Outcome(interval_s, {name: seconds / trials for name, seconds in totals.items()}, horizon_s,
                   failures / trials)


def _trial(model: JobModel, interval_s: float, horizon_s: float, rate: float,
           generator: random.Random) -> tuple[dict[str, float], int]:
    buckets = dict.fromkeys(SIMULATED_BUCKETS, 0.0)
    now, failures = 0.0, 0
    cycle = interval_s + model.checkpoint_s if interval_s > 0 else math.inf
    while now < horizon_s:
        start = min(model.restart_s, horizon_s - now)     # start-up and restore (the first start too)
        buckets["startup"] += start
        now += start
        if now >= horizon_s:
            break
        up = generator.expovariate(rate)                  # training time to the next failure
        span = min(up, horizon_s - now)
        saves = math.floor(span / cycle) if cycle != math.inf else 0
        rest = span - saves * cycle
        buckets["productive"] += saves * interval_s
        buckets["checkpoint_stall"] += saves * model.checkpoint_s
        now += span
        unsaved = min(rest, interval_s) if cycle != math.inf else rest
        buckets["checkpoint_stall"] += rest - unsaved     # a save under way
        if up > span:                                     # the horizon ended first: what ran counts
            buckets["productive"] += unsaved
            break
        failures += 1
        buckets["work_lost"] += unsaved
        if generator.random() < model.hang_share:
            detect = min(model.hang_detect_s, horizon_s - now)
            buckets["hang_detection"] += detect
            now += detect
        wait = model.down_s + (model.requeue_s if generator.random() < model.node_share else 0.0)
        wait = min(wait, max(0.0, horizon_s - now))
        buckets["down"] += wait
        now += wait
    return buckets, failures


def compare(model: JobModel, intervals: Iterable[float], horizon_s: float, trials: int = 200,
            seed: int = 0) -> list[Outcome]:
    """One outcome per interval, each on the same random failures."""
    return [simulate(model, interval, horizon_s, trials, seed) for interval in intervals]


def best_interval(model: JobModel, horizon_s: float, trials: int = 200, seed: int = 0,
                  around: float | None = None) -> Outcome:
    """The interval of highest simulated goodput, searched on a log grid around the Young/Daly
    interval (or ``around``) from a tenth to ten times it."""
    centre = around if around is not None else young_daly_interval(model.checkpoint_s, model.job_mtbf_s)
    centre = max(centre, 1.0)
    grid = [centre * 10 ** (step / 8) for step in range(-8, 9)]
    return max(compare(model, grid, horizon_s, trials, seed), key=lambda outcome: outcome.goodput)


def default_intervals(measured: float | None) -> Sequence[float]:
    """The fixed intervals printed beside the Young/Daly one: 1, 10, 30 minutes, 1 and 3 hours,
    and the measured run's own."""
    fixed = [60.0, 600.0, 1800.0, 3600.0, 10800.0]
    return sorted({*fixed, *([measured] if measured else [])})
