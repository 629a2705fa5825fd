"""When a checkpoint is due: a fixed cadence, or an automatic one within an overhead budget.

:class:`RunCheckpointer` (engine.checkpoint.policy) chooses one :class:`Cadence` at construction
(:func:`choose_cadence`) and never asks which it holds: :class:`FixedCadence` for
``every_n_splits=N`` or None, :class:`AutoCadence` for ``every_n_splits="auto"`` (it times the
splits and hands them to an :class:`~engine.checkpoint.budget.OverheadBudget`). Both also fire
on ``every_n_steps`` and ``every_seconds``.
"""

from __future__ import annotations

import time
from typing import Protocol

from engine.checkpoint.budget import OverheadBudget
from engine.checkpoint.plan import CadencePlan
from engine.checkpoint.writers.worker import BackgroundWork


class Cadence(Protocol):
    """Says whether a checkpoint is due at a split boundary and hears when one was saved."""

    @property
    def interval(self) -> int | None:
        """Splits between checkpoints: the one "auto" reached, the configured one, or None."""

    @property
    def auto_interval(self) -> int | None:
        """The interval ``every_n_splits="auto"`` chose so far (None without "auto")."""

    def start(self, optimizer_steps: int, units_completed: int, background_work: BackgroundWork | None) -> None:
        """The run starts (after any resume) at these counts; ``background_work`` tells whether
        checkpoint work overlapped a split (None: nothing runs in the background)."""

    def due_at_split(self, units_completed: int, optimizer_steps: int) -> bool:
        """Whether a checkpoint is due at this split boundary."""

    def save_starting(self) -> None:
        """A save begins now (its blocking time starts)."""

    def save_ended(self, written: bool, units_completed: int, optimizer_steps: int) -> None:
        """The save begun by :meth:`save_starting` ended: ``written``, or skipped or failed."""


class FixedCadence:
    """Every ``every_n_splits`` splits (or never by splits), every ``every_n_steps`` optimizer
    steps, every ``every_seconds``: whichever comes first."""

    def __init__(self, plan: CadencePlan) -> None:
        self._every_n_splits = plan.every_n_splits
        self._every_n_steps = plan.every_n_steps
        self._every_seconds = plan.every_seconds
        self._last_save_time = time.monotonic()
        self._steps_at_last_save = 0

    @property
    def interval(self) -> int | None:
        return self._every_n_splits

    @property
    def auto_interval(self) -> int | None:
        return None

    def start(self, optimizer_steps: int, units_completed: int, background_work: BackgroundWork | None) -> None:
        self._steps_at_last_save = optimizer_steps

    def due_at_split(self, units_completed: int, optimizer_steps: int) -> bool:
        every = self._every_n_splits
        if every is not None and units_completed % every == 0:
            return True
        return self._due_by_steps_or_time(optimizer_steps)

    def _due_by_steps_or_time(self, optimizer_steps: int) -> bool:
        every_steps = self._every_n_steps
        if every_steps is not None and optimizer_steps // every_steps > self._steps_at_last_save // every_steps:
            return True
        return self._every_seconds is not None and time.monotonic() - self._last_save_time >= self._every_seconds

    def save_starting(self) -> None:
        pass

    def save_ended(self, written: bool, units_completed: int, optimizer_steps: int) -> None:
        if written:
            self._last_save_time = time.monotonic()
            self._steps_at_last_save = optimizer_steps


class AutoCadence(FixedCadence):
    """``every_n_splits="auto"``: as often as ``max_overhead`` allows (engine.checkpoint.budget),
    measured online. The per-split cost: one clock read and a few comparisons."""

    def __init__(self, plan: CadencePlan) -> None:
        super().__init__(plan)
        self._budget = OverheadBudget(plan.max_overhead, plan.mtbf_seconds)
        self._units_at_last_save = 0
        # When the split being timed started, when due_at_split said yes, when the current save
        # began, and whether background checkpoint work ran since a given time (None: none runs).
        self._split_started = time.monotonic()
        self._due_since: float | None = None
        self._save_started = 0.0
        self._background_work: BackgroundWork | None = None

    @property
    def interval(self) -> int | None:
        return self._budget.interval

    auto_interval = interval

    def start(self, optimizer_steps: int, units_completed: int, background_work: BackgroundWork | None) -> None:
        super().start(optimizer_steps, units_completed, background_work)
        self._units_at_last_save = units_completed
        self._background_work = background_work
        self._split_started = time.monotonic()

    def due_at_split(self, units_completed: int, optimizer_steps: int) -> bool:
        now = self._time_split()
        due = units_completed - self._units_at_last_save >= self._budget.interval or \
            self._due_by_steps_or_time(optimizer_steps)
        self._due_since = now if due else None  # a "yes" the ranks did not agree on is dropped
        return due

    def _time_split(self) -> float:
        """Hand the split that just ended to the budget (its time, and whether background work
        overlapped it); the next one starts now."""
        now = time.monotonic()
        started, background_work = self._split_started, self._background_work
        self._budget.note_split(now - started, background_work is not None and background_work(started))
        self._split_started = now
        return now

    def save_starting(self) -> None:
        self._save_started = time.monotonic()

    def save_ended(self, written: bool, units_completed: int, optimizer_steps: int) -> None:
        """The budget records what this checkpoint blocked: since due_at_split said yes, or, for
        a save the run asked for (validation, epoch end, stop), since :meth:`save_starting`;
        there, the time since the last split was timed (epoch-end work, a validation pass) is
        no split's and is dropped. The next split starts now."""
        ended = time.monotonic()
        if written:
            self._budget.record(ended - (self._due_since if self._due_since is not None else self._save_started))
        self._due_since = None
        self._split_started = ended
        super().save_ended(written, units_completed, optimizer_steps)
        if written:
            self._units_at_last_save = units_completed


def choose_cadence(plan: CadencePlan) -> Cadence:
    """The cadence ``plan`` asks for."""
    return AutoCadence(plan) if plan.auto else FixedCadence(plan)
