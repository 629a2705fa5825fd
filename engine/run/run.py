"""One call of ``Trainer.fit``: build the loops, restore a checkpoint, run, save at boundaries.

The order at each boundary, in one place:

- split (:meth:`FitRun._split_boundary`): metrics row -> display -> ``on_split_end`` ->
  validation if due (row, ``on_validation_end``) -> stop checks -> checkpoint (if the policy
  asks, after a validation, or to stop);
- epoch (:meth:`FitRun._epoch_boundary`): display -> the epoch's aggregate row -> validation (row,
  ``on_validation_end``) -> ``on_epoch_end`` -> stop checks -> checkpoint.

After either, a boundary no checkpoint holds is recorded for save on exception
(engine.run.exception_save: an exception ending ``fit`` commits it when it is still exact). A
numerical anomaly (``TrainerConfig.anomaly``) leaves the loops before any optimizer step used it;
:meth:`FitRun._roll_back` restores an earlier checkpoint, records the skipped batches, commits,
and the loops go on (engine.run.rollback).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Iterable, Sequence

import torch

from engine import distributed, faults, watchdog
from engine.callbacks import Callback, RunStatus, RunView
from engine.checkpoint.checkpointing import Checkpointing, NoCheckpoints
from engine.checkpoint.plan import CheckpointPlan
from engine.checkpoint.policy import RunCheckpointer
from engine.checkpoint.tiers.node import MEMORY_PARTS_KEPT
from engine.checkpoint.store.storage import Storage
from engine.config import TrainerConfig
from engine.data.position import EpochData
from engine.errors import ConfigError, ModuleContractError, warn as warn_user
from engine.loops.context import Position, StopState
from engine.loops.stop import run_end, split_boundary_stop_reason
from engine.loops.tree import Boundaries, LoopTree, build_loops
from engine.module import bind_precision, bind_run
from engine.loops.optim_setup import read_optimizer_setup
from engine.result import FitResult
from engine.run import state as run_state
from engine.loops.compiled import original_module
from engine.loops.device import prepare_device, resolve_device
from engine.run.coordinator import join_coordinator
from engine.run.display import Display
from engine.run.exception_save import ExceptionSave, NoExceptionSave
from engine.run.rollback import NoRollbacks, Rollbacks
from engine.loops.anomaly import AnomalyDetected
from engine.loops.logged import MetricLogger
from engine.checkpoint.store.metrics_log import MetricsLog
from engine.loggers.base import LoggerSet
from engine.loggers.hyperparameters import run_info
from engine.run.module_checks import check_module, check_optimizer_setup
from engine.faults.preemption import PreemptionWatcher
from engine.run.preemption import preemption_reason, run_requeue_command
from engine.run.start import ResumedStart, RunStart, announce
from engine.run.weights_file import newest_weights_into
from engine.watchdog.crash_loop import Attempts
from engine.goodput import clock
from engine.goodput.ledger import Ledger
from engine.goodput.observed import observed_mtbf_seconds
from engine.goodput.rows import EXCEPTION, FINISHED, INTERRUPTED, PREEMPTED
from progress import Cursor, ProgressTree


class FitRun:
    """Everything one ``fit`` call needs; see :meth:`engine.Trainer.fit`. Whether the run
    checkpoints (``checkpoints``) and whether it trains alone or in a torchrun group
    (``coordinator``) are objects chosen here, once."""

    def __init__(self, config: TrainerConfig, callbacks: Sequence[Callback], module: torch.nn.Module,
                 train_data: Iterable[Any], storage: Storage | None, val_data: Iterable[Any] | None = None) -> None:
        check_module(module)
        self.config = config
        self.callbacks = list(callbacks)
        self.device = resolve_device(config.device)
        # A torchrun worker joins its process group here.
        self.coordinator = join_coordinator(self.device, config.elastic, config.start_timeout)
        self._group_ready = clock.now()
        prepare_device(module, self.device)  # once, before the optimizers see the parameters
        own = original_module(module)  # the module torch.compile wrapped: unwrapped once, handed down
        configure_model = getattr(own, "configure_model", None)
        if callable(configure_model):
            configure_model()  # where the user shards the model (FSDP2), with the group joined
        self.module = module
        self.setup = read_optimizer_setup(getattr(module, "configure_optimizers")())
        check_optimizer_setup(module, self.setup)
        self.logger = MetricLogger()
        bind_run(own, self.setup, self.logger)
        self.position = Position()
        self.stop = StopState()
        self.data = EpochData(self.coordinator.shard(train_data, config.distributed_sampler), config.preemption_signals,
                              self.coordinator.seed_of_rank_zero)
        self.tree: LoopTree = build_loops(module, self.setup, config, self.data, self.position, self.stop,
                                          Boundaries(self._split_boundary, self._epoch_boundary), self.device,
                                          self.logger, val_data, self.coordinator.context, own=own)
        bind_precision(own, self.tree.precision)
        context = self.coordinator.context
        self.parts = run_state.RunParts(own, self.setup, self.tree, self.callbacks, config,
                                        self.coordinator.world_size, 0 if context is None else context.rank)
        self.storage = storage
        writes_metrics = self.coordinator.is_writer
        chosen = config.loggers if writes_metrics else ()
        export = functools.partial(newest_weights_into, storage.url) if storage is not None and config.checkpoint \
            else None
        loggers = LoggerSet(chosen, run_info(storage, config, original_module(module), export) if chosen else None)
        self.metrics = MetricsLog(storage if writes_metrics else None, loggers)
        self.checkpoints: Checkpointing = (
            self._checkpointer(config, storage) if storage is not None and config.checkpoint else NoCheckpoints(self.metrics))
        self.attempts = Attempts(storage if isinstance(self.checkpoints, RunCheckpointer) else None,
                                 writes_metrics, None if config.watchdog is None else config.watchdog.max_restarts)
        context = self.coordinator.context
        self.ledger = Ledger(storage, 0 if context is None else context.rank, self.coordinator.world_size)
        self._drawn_at_boundary, self._units_at_boundary = 0, 0  # batches drawn when the last boundary was reached (exception save)
        self.exception_save = self._choose_exception_save()
        self.rollbacks = self._choose_rollbacks()
        self.preemption = PreemptionWatcher(config.preemption_signals)
        self.status = RunStatus()
        self.view = RunView(self.status, self._stop_requested_by_callback)
        self.display = Display(config.progress_bar if writes_metrics else "off", config.log_every_seconds,
                               self.data.length, tbptt=self.tree.split is not None)
        self.cursor: Cursor | None = None
        self.resumed_from: str | None = None
        self.resumed_cursor: Cursor | None = None
        self._resumed: ResumedStart | None = None
        self._elapsed_before = 0.0
        self._started = time.monotonic()

    def _checkpointer(self, config: TrainerConfig, storage: Storage) -> RunCheckpointer:
        """The run's checkpointer; under torchrun its group's committer (memory-first with a
        ``local_tier``, engine.distributed.memory_commit)."""
        plan = _checkpoint_plan(config, storage)
        group = self.coordinator.commit_group(plan.tiers, storage, plan.retention.keep_last or MEMORY_PARTS_KEPT)
        return RunCheckpointer(storage, plan, self.metrics, group)

    # ---- running ----------------------------------------------------------------------
    def run(self, resume: str) -> FitResult:
        with self.preemption:
            distributed.register_launched_worker(self.config.preemption_signals)
            try:
                self.ledger.started(self._group_ready)
                self._start(resume)
                self.ledger.restored(self.resumed_from, self.tree.units_completed(), self.tree.step_counter.total,
                                     self.data.epoch_samples(), self.data.sample_id_kind)
                for callback in self.callbacks:
                    callback.on_fit_start(self.view)
                announce(self.display, self.config, self._resumed, self.setup)
                # Where training begins: a process killed while it starts up is no attempt.
                self.attempts.begin(self.resumed_from, lambda: self.coordinator.agree(StopState(), False))
                self.ledger.training()
                self._train()
                watchdog.mark(watchdog.FINISHING)
                if not self.checkpoints.holds(self._boundary_mark()):
                    self._save(force=True)
                closing = time.monotonic()
                self.checkpoints.close(failing=False)
                self.ledger.ended(PREEMPTED if self.stop.preempted else FINISHED, time.monotonic() - closing,
                                  self.tree.units_completed())
                self.attempts.ended()
            except BaseException as error:
                watchdog.end_if_a_peer_hung(error)  # a peer's hang broke this rank's collective: no failure of its own
                self.attempts.ended_by(error, None if self.cursor is None else str(self.cursor))
                self._save_before_raising(error)
                raise
            finally:
                self.metrics.close_loggers()
                self.display.close()
                self.tree.close()
                self.data.close()
                self.coordinator.close()
        self.display.finish(self.tree.fit.progress.total.completed, self.tree.step_counter.total, self.stop.reason)
        if not self.stop.requested:
            for callback in self.callbacks:
                callback.on_fit_end(self.view)
        preempted = self.stop.preempted
        if preempted and self.coordinator.is_writer:
            distributed.write_preemption_marker(self.stop.reason, self.checkpoints.last_name)
            if self.config.requeue_command:
                run_requeue_command(self.config.requeue_command)
        return FitResult(
            cursor=self.cursor,
            epochs_completed=self.tree.fit.progress.total.completed,
            optimizer_steps=self.tree.step_counter.total,
            stop_reason=self.stop.reason,
            resumed_from=self.resumed_from,
            last_checkpoint=self.checkpoints.last_name or self.resumed_from,
            checkpoint_interval=self.checkpoints.checkpoint_interval,
            progress=self._progress(),
            preempted=preempted,
            resumed_cursor=self.resumed_cursor,
            metrics=dict(self.logger.latest),
        )

    def _save_before_raising(self, error: BaseException) -> None:
        """The exception path: commit the last boundary if it is still exact, flush, and say
        in the ledger how the attempt ended and what that commit holds."""
        last = self.checkpoints.last_name
        drawn, units = self._drawn_at_boundary, self._units_at_boundary
        self.exception_save.save_before_raising(error)
        closing = time.monotonic()
        self.checkpoints.close(failing=True)
        committed = self.checkpoints.last_name != last
        cause = EXCEPTION if isinstance(error, Exception) else INTERRUPTED
        self.ledger.ended(cause, time.monotonic() - closing, self.tree.units_completed(),
                          f"{type(error).__name__}: {error}"[:300], units if committed else None,
                          self.data.take_drawn(drawn) if committed else ())

    def _choose_exception_save(self) -> ExceptionSave | NoExceptionSave:
        if not isinstance(self.checkpoints, RunCheckpointer) or not self.config.save_on_exception:
            return NoExceptionSave()
        if self.coordinator.world_size > 1:
            return NoExceptionSave("a distributed run saves only at boundaries every rank agrees on")
        return ExceptionSave(self.parts, self.checkpoints)

    def _choose_rollbacks(self) -> Rollbacks | NoRollbacks:
        policy = self.config.anomaly
        if policy is None:
            return NoRollbacks()
        if not isinstance(self.checkpoints, RunCheckpointer) or self.storage is None:
            raise ConfigError("TrainerConfig.anomaly: Rollback needs checkpoints to roll back to; set run_dir and a "
                              "checkpoint policy")
        checkpoint = self.config.checkpoint
        if self.coordinator.world_size > 1 and checkpoint is not None and checkpoint.local_tier is not None:
            raise ConfigError("TrainerConfig.anomaly: Rollback rolls a torchrun job back to a checkpoint in the run dir, "
                              "and with CheckpointConfig.local_tier most checkpoints are in node memory only; drop "
                              "local_tier under torchrun, or Rollback (not supported together yet)")
        return Rollbacks(policy, self.checkpoints, self.storage, self.coordinator.is_writer, self.data.length)

    def _train(self) -> None:
        """Run the loops; an anomaly (raised before any optimizer step used it) rolls back and
        the loops go on from the restored counters."""
        while True:
            try:
                self.tree.fit.run()
                return
            except AnomalyDetected as anomaly:
                self._roll_back(anomaly)

    def _roll_back(self, anomaly: AnomalyDetected) -> None:
        """Restore the checkpoint the rollback policy chooses, record the rollback and the
        batches it skips in the progress, and commit at once (engine.run.rollback)."""
        history = self.tree.epoch.anomalies
        earlier = list(history.records)
        loaded, record = self.rollbacks.plan(anomaly, earlier, self.tree.step_counter.total)
        restored = run_state.restore(loaded.name, loaded.state, loaded.progress, self.parts, loaded.extra_files)
        self.metrics.roll_back_to(restored.metrics_bytes, self.tree.step_counter.total)
        # Every rollback so far, even one the restored checkpoint predates: its batches stay skipped.
        history.load([*earlier, record])
        self.data.take_drawn()  # the replay draws them again
        self.cursor = loaded.progress.cursor
        self._update_status()
        faults.reach("after_rollback")
        self._save(force=True)
        self.rollbacks.publish(history.records)
        warn_user(f"splitloop: {record.describe()}")

    def _start(self, resume: str) -> None:
        """Restore the checkpoint ``resume`` chooses (engine.run.start) or start fresh, then
        start the checkpoint writer."""
        resumed = self._resumed = RunStart(self.config, self.checkpoints, self.parts, self.metrics,
                                           self.stop).begin(resume)
        if resumed is not None:
            loaded = resumed.loaded
            self._elapsed_before = resumed.elapsed_seconds
            self.cursor = self.resumed_cursor = loaded.progress.cursor
            self.resumed_from = loaded.name
            watchdog.resumed_at(self.tree.units_completed())
            self.metrics.record_resume(loaded.name, self.cursor, self.tree.step_counter.total, time.time(),
                                      resumed.world_size_before, self.coordinator.world_size,
                                      None if resumed.fallback is None else resumed.fallback.record())
            self.rollbacks.publish(self.tree.epoch.anomalies.records)  # a kill may have come before the last write
            self._update_status()
            # A resumed run re-evaluates the split-boundary predicates before doing any work.
            reason = split_boundary_stop_reason(self.tree.step_counter.total, self.config.max_steps,
                                                self._elapsed(), self.config.max_time)
            if reason is not None:
                self.stop.request(reason)
        self.checkpoints.start(self.tree.step_counter.total, self._boundary_mark() if resumed is not None else None)

    def _stop_requested_by_callback(self, reason: object) -> None:
        # A None reason would read as "no stop requested", and FitResult.stop_reason is a str.
        if not isinstance(reason, str) or not reason.strip():
            raise ModuleContractError(f"RunView.request_stop: the reason must be a non-empty string saying why the "
                                      f"run stops, got {reason!r}")
        self.stop.request(reason)

    def _elapsed(self) -> float:
        return self._elapsed_before + time.monotonic() - self._started

    def _boundary_mark(self) -> tuple[int, int]:
        """Names the last boundary reached (units of step work and epochs completed): a
        checkpoint taken at the same mark holds the current state."""
        return self.tree.units_completed(), self.tree.fit.progress.total.completed

    def _update_status(self, losses: list[float] | None = None) -> None:
        status = self.status
        status.cursor = self.cursor
        status.optimizer_steps = self.tree.step_counter.total
        status.epochs_completed = self.tree.fit.progress.total.completed
        status.metrics = dict(self.logger.latest)
        if losses is not None:
            status.losses = losses

    # ---- boundaries -------------------------------------------------------------------
    def _split_boundary(self, split_index: int, losses: list[torch.Tensor]) -> None:
        watchdog.split_done(watchdog.BOUNDARY)
        position = self.position
        cursor = self.cursor = Cursor(position.epoch, position.batch, split_index, len(losses) - 1)
        values, synced = self.coordinator.mean_losses([loss.item() for loss in losses],
                                                      self.logger.synced_split_payload())
        steps = self.tree.step_counter.total
        self.metrics.append(cursor, values, steps, self.logger.end_split(synced))
        self.display.update(cursor, values[0], steps)
        self._update_status(values)
        for callback in self.callbacks:
            callback.on_split_end(self.view)
        self.ledger.beat_if_due(self.tree.units_completed())
        validated = self._validate_if_due(steps)
        self.tree.monitored.after_unit(self.tree.units_completed(), self.logger.latest)
        faults.reach("split_end")
        self._check_stop(steps)
        self.checkpoints.check()
        due = self.checkpoints.due_at_split(self.tree.units_completed(), steps, asked=self.stop.requested or validated)
        if self.coordinator.agree(self.stop, due):
            self._save(force=self.stop.requested)
        self._remember_boundary()
        faults.reach("split_end_after_checkpoint")

    def _check_stop(self, steps: int) -> None:
        if self.preemption.received is not None:
            self.stop.request_preemption(preemption_reason(self.preemption.received))
        reason = split_boundary_stop_reason(steps, self.config.max_steps, self._elapsed(), self.config.max_time)
        if reason is not None:
            self.stop.request(reason)

    def _validate_if_due(self, steps: int) -> bool:
        evaluation, every = self.tree.evaluation, self.config.val_every_n_steps
        if evaluation is None or every is None or not evaluation.due_after_steps(steps, every):
            return False
        self._validate(steps)
        return True

    def _validate(self, steps: int) -> None:
        assert self.tree.evaluation is not None
        watchdog.mark(watchdog.VALIDATION)
        began = time.monotonic()
        values = self.tree.evaluation.run(steps)
        self.ledger.validated(time.monotonic() - began)
        watchdog.mark(watchdog.BOUNDARY)
        self.metrics.append_aggregate("val", self.cursor, steps, values)
        self.checkpoints.offer_metrics(values)
        self._update_status()
        for callback in self.callbacks:
            callback.on_validation_end(self.view)

    def _epoch_boundary(self, epoch: int) -> None:
        self.display.end_epoch(epoch)
        steps = self.tree.step_counter.total
        aggregates = self.logger.end_epoch()
        if aggregates:
            self.metrics.append_aggregate("train_epoch", self.cursor, steps, aggregates)
            self.checkpoints.offer_metrics(aggregates)
        evaluation = self.tree.evaluation
        if evaluation is not None and self.config.val_at_epoch_end and not evaluation.current_at(steps):
            self._validate(steps)
        self._check_monitor_exists()
        self.tree.monitored.after_epoch(self.tree.fit.progress.total.completed, self.logger.latest)
        self._update_status()
        for callback in self.callbacks:
            callback.on_epoch_end(self.view)
        faults.reach("epoch_end")
        self._check_stop(self.tree.step_counter.total)
        if self.coordinator.agree(self.stop, self.checkpoints.due_at_epoch_end(asked=self.stop.requested)):
            self._save(force=self.stop.requested)
        self._remember_boundary()

    def _check_monitor_exists(self) -> None:
        monitor = self.config.checkpoint.monitor if self.config.checkpoint is not None else None
        if monitor is not None and monitor not in self.logger.latest:
            raise ConfigError(f"CheckpointConfig.monitor={monitor!r}: no such metric after a whole epoch; "
                              f"the run has {sorted(self.logger.latest)}")

    # ---- saving -----------------------------------------------------------------------
    def _progress(self) -> ProgressTree:
        """The progress of every loop, with how the run ended if it did. The stop is part of
        the checkpoint: a run killed right after its stopping commit, or started again once it
        ended, stays finished (a preemption is not an end)."""
        progress = self.tree.progress_tree(self.cursor)
        config = self.config
        progress.end = run_end(self.stop.finish_reason, self.tree.fit.progress.total.completed,
                               config.max_epochs, config.max_steps, config.max_time)
        return progress

    def _remember_boundary(self) -> None:
        """What an exception before the next boundary saves (engine.run.exception_save)."""
        self.exception_save.remember(self._progress(), self.cursor, self.tree.step_counter.total,
                                     self._boundary_mark(), self.metrics, self._elapsed())
        self._drawn_at_boundary, self._units_at_boundary = self.data.drawn_count(), self.tree.units_completed()

    def _save(self, force: bool = False) -> None:
        watchdog.mark(watchdog.CHECKPOINT)
        began = time.monotonic()
        self.exception_save.forget()
        # Seal the buffered metrics lines: the checkpoint records, and its commit publishes, them.
        snapshot = run_state.capture(self.parts, self._progress(), self.metrics.snapshot(), self._elapsed())
        saved = self.checkpoints.save(snapshot, self.cursor, self.tree.step_counter.total, self._boundary_mark(), force)
        units, epochs = self._boundary_mark()
        self.ledger.commit(saved, time.monotonic() - began, units, epochs, self.tree.step_counter.total,
                           self.data.take_drawn() if saved else ())
        self.display.note_checkpoint(saved, self.checkpoints.auto_interval)
        watchdog.mark(watchdog.BOUNDARY)


def _checkpoint_plan(config: TrainerConfig, storage: Storage) -> CheckpointPlan:
    """The run's checkpoint plan, built once; a cadence that weighs failures gets the failure
    rate the run's ledger observed over its earlier attempts (engine.goodput)."""
    assert config.checkpoint is not None
    plan = config.checkpoint.plan()
    return plan.with_observed_mtbf(observed_mtbf_seconds(storage)) if plan.cadence.observes_failures else plan
