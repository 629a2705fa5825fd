"""``engine.Watchdog``: the hang detector's settings (re-exported by engine.config)."""

from __future__ import annotations

import dataclasses

from engine.errors import ConfigError
from engine.field_checks import positive_int_or_none, positive_number_or_none


@dataclasses.dataclass(frozen=True)
class Watchdog:
    """Hang detection (docs/faults.md, "Hangs"), on by default: every rank publishes a progress
    word (splits completed, phase, when the phase began) that a monitor thread reads without the
    rank's help; a rank whose word has not moved for ``max(min_timeout_s, factor x p99)`` of its
    current phase (learned online, per phase, after ``warmup`` samples; ``first_timeout_s`` until
    then: the first split and its compilation, a checkpoint load, a validation pass) is hung: the
    monitor writes one report (rank, host, phase, how long, the last split, the Python stacks) to
    stderr and ``hangs.jsonl``, and the process exits with ``engine.watchdog.HANG_EXIT_CODE`` so
    that torchrun (``--max-restarts``) or the scheduler restarts the job from its newest checkpoint.
    A hung checkpoint writer under ``CheckpointConfig(on_io_error="warn")`` (a process alone, a
    thread or process writer) is abandoned and replaced at that timeout instead, and training goes
    on (docs/faults.md, "A hung writer").

    Args:
        min_timeout_s: no phase is called hung before this many seconds without progress. The
            default, 5 minutes, is NVIDIA's resiliency-extension heartbeat: generous enough that a
            loaded machine never trips it, short against gloo/NCCL's 10-30 minutes.
        factor: a phase is hung after ``factor`` times the 99th percentile of its durations seen so far.
        first_timeout_s: the allowance of a phase seen fewer than ``warmup`` times (30 minutes:
            a first split that compiles, a restore from a slow store, a whole validation pass).
        warmup: how many durations of a phase are seen before its own p99 applies.
        poll_s: how often the monitor looks; None: a twentieth of ``min_timeout_s``, at most 1 s.
        max_restarts: crash loops (engine.watchdog.crash_loop): a start whose last ``max_restarts``
            starts all resumed from the checkpoint it resumes from (nothing committed since), or
            that follows two failures at the same split with the same exception, exits with
            ``engine.watchdog.CRASH_LOOP_EXIT_CODE`` ("do not requeue") and a verdict line. None: never.
        straggler_factor: a rank whose own work per split (its waits left out) stays this many
            times the fastest local rank's, or its own earlier pace, for ``straggler_window`` of
            its splits is reported (a line, ``stragglers.jsonl``), never stopped. None: not watched.
        straggler_window: splits a rank must stay that slow before it is reported.

    Example::

        engine.TrainerConfig(run_dir="runs/lm", watchdog=engine.Watchdog(min_timeout_s=120, factor=10))
    """

    min_timeout_s: float = 300.0
    factor: float = 5.0
    first_timeout_s: float = 1800.0
    warmup: int = 10
    poll_s: float | None = None
    max_restarts: int | None = 3
    straggler_factor: float | None = 1.3
    straggler_window: int = 10

    def __post_init__(self) -> None:
        owner = "Watchdog"
        for name in ("min_timeout_s", "factor", "first_timeout_s"):
            positive_number_or_none(owner, name, getattr(self, name))
            if getattr(self, name) is None:
                raise ConfigError(f"{owner}.{name}: expected a positive finite number, got None")
        if self.factor < 1:
            raise ConfigError(f"{owner}.factor: expected a number >= 1 (times the p99 of a phase), got {self.factor!r}")
        positive_int_or_none(owner, "warmup", self.warmup)
        if self.warmup is None:
            raise ConfigError(f"{owner}.warmup: expected a positive int, got None")
        positive_number_or_none(owner, "poll_s", self.poll_s)
        positive_int_or_none(owner, "max_restarts", self.max_restarts)
        positive_number_or_none(owner, "straggler_factor", self.straggler_factor)
        if self.straggler_factor is not None and self.straggler_factor <= 1:
            raise ConfigError(f"{owner}.straggler_factor: expected a number above 1 (times the fastest rank) or None, "
                              f"got {self.straggler_factor!r}")
        positive_int_or_none(owner, "straggler_window", self.straggler_window)
        if self.straggler_window is None:
            raise ConfigError(f"{owner}.straggler_window: expected a positive int, got None")

    @property
    def poll_seconds(self) -> float:
        """How often the monitor reads the progress words."""
        return self.poll_s if self.poll_s is not None else min(1.0, self.min_timeout_s / 20)
