"""A run's checkpoint plan: ``CheckpointConfig`` resolved once, with every rule that ties its
fields together and its refusal.

``CheckpointConfig`` (engine.config) checks each field on its own and builds a plan to check the
rest (so that a bad combination is refused where the configuration is made); ``Trainer.fit``
builds the plan a run uses, once, and :meth:`CheckpointPlan.refuse_where` refuses what cannot
work where the run writes (several processes, a run dir that is not local). The parts of the run's
checkpointer read their part of the plan (:class:`CadencePlan`, :class:`WriterPlan`,
:class:`RetentionPlan`, :class:`TierPlan`), never the configuration.

This module imports no torch: a configuration is checked without it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Protocol

from engine.checkpoint.tiers.tiering import TierPlan
from engine.checkpoint.writers.choice import WRITER_KINDS
from engine.errors import ConfigError

OWNER = "CheckpointConfig"
# The writer that writes on the training thread (max_in_flight and when_behind apply to the others only).
SYNCHRONOUS = "sync"


class CheckpointSettings(Protocol):
    """The fields of engine.config.CheckpointConfig a plan is built from (this package does not
    import engine.config)."""

    every_n_splits: int | Literal["auto"] | None
    every_n_steps: int | None
    every_seconds: float | None
    at_epoch_end: bool
    max_overhead: float
    mtbf_seconds: float | Literal["observed"] | None
    keep_last: int | None
    monitor: str | None
    mode: Literal["min", "max"]
    keep_best: int
    writer: str
    max_in_flight: int
    when_behind: Literal["wait", "skip"]
    on_io_error: Literal["raise", "warn"]
    lease_expiry_seconds: float
    local_tier: str | None
    durable_every_n_splits: int | None
    durable_every_seconds: float | None
    peer_copies: int


@dataclasses.dataclass(frozen=True)
class CadencePlan:
    """When a checkpoint is due (engine.checkpoint.cadence)."""

    # Splits between checkpoints (None: not by splits, or chosen online when ``auto``).
    every_n_splits: int | None
    auto: bool
    # With ``auto``: the fraction of training time checkpoints may cost, and the job's mean time
    # between failures (None: not weighed; engine.checkpoint.budget).
    max_overhead: float
    mtbf_seconds: float | None
    # Whether the failure rate the run's ledger observed replaces ``mtbf_seconds`` when the run
    # starts (engine.run.run).
    observes_failures: bool
    every_n_steps: int | None
    every_seconds: float | None
    at_epoch_end: bool


@dataclasses.dataclass(frozen=True)
class WriterPlan:
    """Who writes (a key of engine.checkpoint.writers.choice.WRITER_KINDS) and how it behaves."""

    kind: str
    max_in_flight: int
    when_behind: str
    on_io_error: str
    lease_expiry_seconds: float


@dataclasses.dataclass(frozen=True)
class RetentionPlan:
    """What is kept (engine.checkpoint.store.retention)."""

    keep_last: int | None
    monitor: str | None
    mode: str
    # Best checkpoints by ``monitor`` never deleted (0 without a monitor).
    keep_best: int


@dataclasses.dataclass(frozen=True)
class CheckpointPlan:
    """A run's checkpoint plan (see the module docstring)."""

    cadence: CadencePlan
    writer: WriterPlan
    retention: RetentionPlan
    tiers: TierPlan

    @classmethod
    def from_config(cls, config: CheckpointSettings) -> CheckpointPlan:
        """The plan ``config`` asks for, each field already checked on its own.

        Raises:
            ConfigError: for a combination the plan cannot honour, naming the fields.
        """
        _refuse_what_would_be_ignored(config)
        _refuse_an_unknown_writer(config)
        _refuse_a_tier_without_its_cadence(config)
        every = config.every_n_splits
        return cls(
            cadence=CadencePlan(every if isinstance(every, int) else None, every == "auto", config.max_overhead,
                                None if config.mtbf_seconds == "observed" else config.mtbf_seconds,
                                config.mtbf_seconds is not None, config.every_n_steps, config.every_seconds,
                                config.at_epoch_end),
            writer=WriterPlan(config.writer, config.max_in_flight, config.when_behind, config.on_io_error,
                              config.lease_expiry_seconds),
            retention=RetentionPlan(config.keep_last, config.monitor, config.mode,
                                    config.keep_best if config.monitor is not None else 0),
            tiers=TierPlan(config.local_tier, config.durable_every_n_splits, config.durable_every_seconds,
                           config.peer_copies),
        )

    def with_observed_mtbf(self, mtbf_seconds: float | None) -> CheckpointPlan:
        """This plan with the mean time between failures a run's ledger observed (None: none
        seen yet, the configured prior stays), where the plan asks for it."""
        if not self.cadence.observes_failures or mtbf_seconds is None:
            return self
        return dataclasses.replace(self, cadence=dataclasses.replace(self.cadence, mtbf_seconds=mtbf_seconds))

    def refuse_where(self, distributed: bool, run_dir_url: str, run_dir_is_local: bool) -> None:
        """Refuse what this plan cannot do where the run writes: with several processes
        (``distributed``: a torchrun group), or into a run dir that is not on a local filesystem.

        Raises:
            ConfigError: naming the field and what to use instead.
        """
        if not distributed and self.tiers.peer_copies:
            raise ConfigError(f"{OWNER}.peer_copies={self.tiers.peer_copies} copies each rank's memory parts to "
                              "another node of a torchrun job; this run is one process: set peer_copies=0")
        if self.writer.kind == "process" and self.tiers.local_tier is not None and not distributed:
            raise ConfigError(f"{OWNER}.writer='process' is not supported with local_tier in a process alone yet "
                              f"(got local_tier={self.tiers.local_tier!r}); use writer='thread' with a fast tier "
                              "(under torchrun, a writer process writes each rank's memory tier)")
        if self.writer.kind == "process" and not run_dir_is_local:
            raise ConfigError(f"{OWNER}.writer='process' needs a local run dir for now, got {run_dir_url!r}; "
                              "use writer='thread' there")


def _refuse_what_would_be_ignored(config: CheckpointSettings) -> None:
    """Refuse a field set to a non-default value that the rest of the configuration would ignore."""
    if config.writer == SYNCHRONOUS:
        for name, default in (("max_in_flight", 1), ("when_behind", "wait")):
            if getattr(config, name) != default:
                raise ConfigError(f"{OWNER}.{name}={getattr(config, name)!r} applies to checkpoints written in the "
                                  "background only, but writer is 'sync'; set writer='thread' (or 'process') or drop it")
    if config.monitor is None:
        for name, default in (("mode", "min"), ("keep_best", 1)):
            if getattr(config, name) != default:
                raise ConfigError(f"{OWNER}.{name}={getattr(config, name)!r} applies to best checkpoints only, but "
                                  "monitor is None; set monitor to a metric name (e.g. 'val_loss') or drop it")
    elif config.monitor != config.monitor.strip():
        raise ConfigError(f"{OWNER}.monitor: {config.monitor!r} has leading or trailing whitespace; "
                          "give the metric name exactly as it is logged")
    auto_only: tuple[tuple[str, object], ...] = (("max_overhead", 0.05), ("mtbf_seconds", None))
    if config.every_n_splits != "auto":
        for field, unset in auto_only:
            if getattr(config, field) != unset:
                raise ConfigError(f"{OWNER}.{field}={getattr(config, field)!r} applies to every_n_splits='auto' only, "
                                  f"but every_n_splits is {config.every_n_splits!r}; set every_n_splits='auto' or drop it")


def _refuse_an_unknown_writer(config: CheckpointSettings) -> None:
    if config.writer not in WRITER_KINDS:
        raise ConfigError(f"{OWNER}.writer: expected one of {list(WRITER_KINDS)}, got {config.writer!r}")


def _refuse_a_tier_without_its_cadence(config: CheckpointSettings) -> None:
    if config.local_tier is None and config.peer_copies:
        raise ConfigError(f"{OWNER}.peer_copies={config.peer_copies} copies the memory tier's parts to a peer node; "
                          "set local_tier (e.g. '/dev/shm/<run>') or drop it")
    if config.local_tier is None:
        if config.durable_every_n_splits is not None or config.durable_every_seconds is not None:
            raise ConfigError(f"{OWNER}.durable_every_n_splits / durable_every_seconds: only meaningful with "
                              "local_tier (without a fast tier every checkpoint is durable); set local_tier or drop them")
    elif config.durable_every_n_splits is None and config.durable_every_seconds is None:
        raise ConfigError(f"{OWNER}.local_tier={config.local_tier!r}: say how often checkpoints reach the run dir "
                          "with durable_every_n_splits and/or durable_every_seconds")
