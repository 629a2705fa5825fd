"""One call of ``Trainer.fit``: build the loops, restore a checkpoint, run, save at boundaries.

The order at each boundary, in one place:

- split (:meth:`FitRun._split_boundary`): metrics row -> display -> ``on_split_end`` ->
  validation if due (row, ``on_validation_end``) -> stop checks -> checkpoint (if the policy
  asks, after a validation, or to stop);
- epoch (:meth:`FitRun._epoch_boundary`): display -> the epoch's aggregate row -> validation (row,
  ``on_validation_end``) -> ``on_epoch_end`` -> stop checks -> checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Iterable, Sequence

import torch

from engine import distributed, faults
from engine.callbacks import Callback, RunStatus, RunView
from engine.checkpoint.abandoned import describe_names
from engine.checkpoint.policy import RunCheckpointer
from engine.checkpoint.storage import Storage
from engine.checkpoint.store import LoadedCheckpoint
from engine.config import TrainerConfig
from engine.data.position import EpochData
from engine.errors import CheckpointNotFound, ConfigError, ModuleContractError
from engine.loops.context import Position, StopState
from engine.loops.stop import run_end, split_boundary_stop_reason
from engine.loops.tree import Boundaries, LoopTree, build_loops
from engine.module import bind_precision, bind_run
from engine.loops.optim_setup import read_optimizer_setup
from engine.result import FitResult
from engine.run import state as run_state
from engine.loops.compiled import original_module
from engine.loops.device import prepare_device, resolve_device
from engine.run.display import Display
from engine.loops.logged import MetricLogger
from engine.checkpoint.metrics_log import MetricsLog
from engine.run.module_checks import check_module, check_optimizer_setup
from engine.run.overrides import BuiltSettings, overridden_settings
from engine.faults.preemption import PreemptionWatcher
from engine.run.preemption import run_requeue_command
from progress import Cursor, ProgressTree, RunEnd


@dataclasses.dataclass
class ResumedStart:
    """What the start line of a resumed run says: the checkpoint, the settings
    configure_optimizers built before the restore, and what the checkpoint's end means."""

    loaded: LoadedCheckpoint
    built: BuiltSettings
    end_note: str | None


class FitRun:
    """Everything one ``fit`` call needs; see :meth:`engine.Trainer.fit`."""

    def __init__(self, config: TrainerConfig, callbacks: Sequence[Callback], module: torch.nn.Module,
                 train_data: Iterable[Any], storage: Storage | None, val_data: Iterable[Any] | None = None) -> None:
        check_module(module)
        self.config = config
        self.callbacks = list(callbacks)
        self.device = resolve_device(config.device)
        # A torchrun worker joins its process group here (None when this process runs alone).
        self.distributed = distributed.join(self.device)
        prepare_device(module, self.device)  # once, before the optimizers see the parameters
        self.module = module
        self.setup = read_optimizer_setup(getattr(module, "configure_optimizers")())
        check_optimizer_setup(module, self.setup)
        self.logger = MetricLogger()
        bind_run(original_module(module), self.setup, self.logger)
        self.position = Position()
        self.stop = StopState()
        if self.distributed is not None and config.distributed_sampler:
            train_data = distributed.shard_loader(train_data, self.distributed)
        self.data = EpochData(train_data, config.preemption_signals)
        self.tree: LoopTree = build_loops(module, self.setup, config, self.data, self.position, self.stop,
                                          Boundaries(self._split_boundary, self._epoch_boundary), self.device,
                                          self.logger, val_data, self.distributed)
        bind_precision(original_module(module), self.tree.precision)
        world_size = 1 if self.distributed is None else self.distributed.world_size
        self.parts = run_state.RunParts(original_module(module), self.setup, self.tree, self.callbacks, config, world_size)
        self.storage = storage
        writes_metrics = self.distributed is None or self.distributed.is_writer
        self.metrics = MetricsLog(storage if writes_metrics else None)
        group = None if self.distributed is None else distributed.GroupCommit(self.distributed)
        self.checkpoints = (RunCheckpointer(storage, config.checkpoint, self.metrics, group)
                            if storage is not None and config.checkpoint else None)
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

    # ---- running ----------------------------------------------------------------------
    def run(self, resume: str) -> FitResult:
        with self.preemption:
            distributed.register_launched_worker(self.config.preemption_signals)
            try:
                self._start(resume)
                for callback in self.callbacks:
                    callback.on_fit_start(self.view)
                self._announce_start()
                self.tree.fit.run()
                if self.checkpoints is not None:
                    if not self.checkpoints.holds(self._boundary_mark()):
                        self._save(force=True)
                    self.checkpoints.close(failing=False)
                else:
                    self.metrics.flush()
            except BaseException:
                if self.checkpoints is not None:
                    self.checkpoints.close(failing=True)
                raise
            finally:
                self.display.close()
                self.tree.close()
                self.data.close()
        self.display.finish(self.tree.fit.progress.total.completed, self.tree.step_counter.total, self.stop.reason)
        if not self.stop.requested:
            for callback in self.callbacks:
                callback.on_fit_end(self.view)
        preempted = self.stop.preempted
        if preempted and (self.distributed is None or self.distributed.is_writer):
            distributed.write_preemption_marker(self.stop.reason,
                                                None if self.checkpoints is None else self.checkpoints.last_name)
            if self.config.requeue_command:
                run_requeue_command(self.config.requeue_command)
        return FitResult(
            cursor=self.cursor,
            epochs_completed=self.tree.fit.progress.total.completed,
            optimizer_steps=self.tree.step_counter.total,
            stop_reason=self.stop.reason,
            resumed_from=self.resumed_from,
            last_checkpoint=self._last_checkpoint(),
            checkpoint_interval=None if self.checkpoints is None else self.checkpoints.checkpoint_interval,
            progress=self._progress(),
            preempted=preempted,
            resumed_cursor=self.resumed_cursor,
            metrics=dict(self.logger.latest),
        )

    def _start(self, resume: str) -> None:
        if self.checkpoints is None:
            if resume not in ("auto", "off"):
                raise CheckpointNotFound(f"resume={resume!r} needs TrainerConfig.run_dir and a checkpoint policy")
            self._start_fresh()
            return
        self.checkpoints.acquire()
        if resume == "off":
            self._warn_fresh_over_checkpoints()
        loaded = self.checkpoints.select(resume, run_state.validate)
        if loaded is not None and resume.startswith("ckpt-"):
            self._abandon_newer(loaded.name)
        if loaded is None:
            self._start_fresh()
        else:
            restored = run_state.restore(loaded.name, loaded.state, loaded.progress, self.parts)
            self.metrics.resume_at(restored.metrics_bytes)
            self._elapsed_before = restored.elapsed_seconds
            self.cursor = self.resumed_cursor = loaded.progress.cursor
            self.resumed_from = loaded.name
            self.metrics.record_resume(loaded.name, self.cursor, self.tree.step_counter.total, time.time())
            self._resumed = ResumedStart(loaded, restored.built, self._resume_end(loaded.progress.end))
            self._update_status()
            # A resumed run re-evaluates the split-boundary predicates before doing any work.
            reason = split_boundary_stop_reason(self.tree.step_counter.total, self.config.max_steps,
                                                self._elapsed(), self.config.max_time)
            if reason is not None:
                self.stop.request(reason)
        self.checkpoints.start(self.tree.step_counter.total, self._boundary_mark() if loaded is not None else None)

    def _resume_end(self, end: RunEnd | None) -> str | None:
        """A checkpoint of a finished run: stop at once (nothing more to train) unless a limit
        was raised since; returns what the start line says about it (None: the run had not ended)."""
        if end is None:
            return None
        config = self.config
        raised = end.raised_limits(config.max_epochs, config.max_steps, config.max_time)
        if raised:
            return f"the run had finished ({end.reason}); {', '.join(raised)}: training on"
        self.stop.request(end.reason)
        return (f"the run has finished ({end.reason}): nothing more to train; raise max_epochs, max_steps or "
                "max_time to train on")

    def _announce_start(self) -> None:
        """The start line, once the callbacks' on_fit_start ran (they may set hyper-parameters
        after the restore): a resumed run also says whether it had finished and which settings
        of configure_optimizers the checkpoint replaced, the latter as a warning too."""
        resumed = self._resumed
        if resumed is None:
            self.display.start(self.config.run_dir, None)
            return
        notes = [resumed.end_note, self._overridden(resumed.loaded.name, overridden_settings(resumed.built, self.setup))]
        self.display.start(self.config.run_dir, resumed.loaded, [note for note in notes if note])

    def _overridden(self, name: str, overridden: list[str]) -> str | None:
        if not overridden:
            return None
        text = (f"{name} overrides what configure_optimizers built: {'; '.join(overridden)}; the run goes on with the "
                "checkpoint's values (to change them on resume, set them in a callback's on_fit_start: "
                "docs/guarantees.md, Changing hyper-parameters on resume)")
        warnings.warn(text, stacklevel=5)
        return text

    def _last_checkpoint(self) -> str | None:
        """The run's newest checkpoint: the last one this call wrote, else the one it resumed from."""
        if self.checkpoints is None:
            return None
        return self.checkpoints.last_name or self.resumed_from

    def _stop_requested_by_callback(self, reason: object) -> None:
        # A None reason would read as "no stop requested", and FitResult.stop_reason is a str.
        if not isinstance(reason, str) or not reason.strip():
            raise ModuleContractError(f"RunView.request_stop: the reason must be a non-empty string saying why the "
                                      f"run stops, got {reason!r}")
        self.stop.request(reason)

    def _abandon_newer(self, name: str) -> None:
        """resume="ckpt-…" from an older checkpoint: the newer ones are left behind; say so
        before anything is deleted (engine.checkpoint.abandoned)."""
        assert self.checkpoints is not None and self.config.checkpoint is not None
        newer = self.checkpoints.abandon_newer_than(name)
        if not newer:
            return
        keep_last = self.config.checkpoint.keep_last
        fate = ("kept (keep_last=None)" if keep_last is None else
                "kept until this run commits its first checkpoint, then deleted by retention (to keep them, stop "
                "now and copy them elsewhere)")
        warnings.warn(f"resume={name!r}: {self.config.run_dir} holds {len(newer)} newer checkpoint(s), "
                      f"{describe_names(newer)}, of the history this run branches off; resume='auto' no longer "
                      f"returns to them; they are {fate}", stacklevel=5)

    def _warn_fresh_over_checkpoints(self) -> None:
        """resume="off" in a run dir that holds checkpoints: say that retention will delete them."""
        assert self.checkpoints is not None and self.config.checkpoint is not None
        keep_last = self.config.checkpoint.keep_last
        existing = sorted(self.checkpoints.store.committed_names())
        if existing and keep_last is not None:
            warnings.warn(f"resume='off': starting a fresh run in {self.config.run_dir}, which holds {len(existing)} "
                          f"checkpoint(s) of an earlier run (newest {existing[-1]}); retention (keep_last={keep_last}) "
                          "deletes them as this run commits new ones. To keep them, stop now and use another run_dir",
                          stacklevel=5)

    def _start_fresh(self) -> None:
        self.metrics.start_fresh()
        if self.tree.evaluation is not None:
            self.tree.evaluation.choose_seed()

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
        position = self.position
        cursor = self.cursor = Cursor(position.epoch, position.batch, split_index, len(losses) - 1)
        values = [loss.item() for loss in losses]
        if self.distributed is not None:
            values = distributed.mean_losses(self.distributed, values)
        steps = self.tree.step_counter.total
        self.metrics.append(cursor, values, steps, self.logger.end_split())
        self.display.update(cursor, values[0], steps)
        self._update_status(values)
        for callback in self.callbacks:
            callback.on_split_end(self.view)
        validated = self._validate_if_due(steps)
        faults.reach("split_end")
        self._check_stop(steps)
        if self.checkpoints is not None:
            self.checkpoints.check()
        due = self.checkpoints is not None and (
            self.stop.requested or validated or self.checkpoints.due_at_split(self.tree.units_completed(), steps))
        if self.distributed is not None:
            due = self._agree(due)
        if due:
            self._save(force=self.stop.requested)
        faults.reach("split_end_after_checkpoint")

    def _check_stop(self, steps: int) -> None:
        if self.preemption.received is not None:
            self.stop.request_preemption(self.preemption.reason)
        reason = split_boundary_stop_reason(steps, self.config.max_steps, self._elapsed(), self.config.max_time)
        if reason is not None:
            self.stop.request(reason)

    def _agree(self, checkpoint_due: bool) -> bool:
        """Distributed: every rank takes the same stop and checkpoint decisions at this boundary."""
        assert self.distributed is not None
        agreed = distributed.agree(self.distributed, self.stop.preempted, self.stop.requested, checkpoint_due)
        # Every rank's checkpoint records the same end (the progress is checked equal across
        # ranks): the reason of a rank that stopped by itself, agreed before the others fill one in.
        finish_reason = distributed.agree_on_reason(self.distributed, self.stop.finish_reason) if agreed.stop else None
        if agreed.preempted and not self.stop.preempted:
            self.stop.request_preemption("preempted (the signal reached another rank)")
        elif agreed.stop and not self.stop.requested:
            self.stop.request("stop requested on another rank")
        if agreed.stop:
            self.stop.finish_reason = finish_reason
        return agreed.checkpoint and self.checkpoints is not None

    def _validate_if_due(self, steps: int) -> bool:
        evaluation, every = self.tree.evaluation, self.config.val_every_n_steps
        if evaluation is None or every is None or not evaluation.due_after_steps(steps, every):
            return False
        self._validate(steps)
        return True

    def _validate(self, steps: int) -> None:
        assert self.tree.evaluation is not None
        values = self.tree.evaluation.run(steps)
        self.metrics.append_aggregate("val", self.cursor, steps, values)
        if self.checkpoints is not None:
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
            if self.checkpoints is not None:
                self.checkpoints.offer_metrics(aggregates)
        evaluation = self.tree.evaluation
        if evaluation is not None and self.config.val_at_epoch_end and not evaluation.current_at(steps):
            self._validate(steps)
        self._check_monitor_exists()
        self._update_status()
        for callback in self.callbacks:
            callback.on_epoch_end(self.view)
        faults.reach("epoch_end")
        self._check_stop(self.tree.step_counter.total)
        due = self.checkpoints is not None and (self.stop.requested or self.checkpoints.due_at_epoch_end())
        if self.distributed is not None:
            due = self._agree(due)
        if due:
            self._save(force=self.stop.requested)

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

    def _save(self, force: bool = False) -> None:
        snapshot = run_state.capture(self.parts, self._progress(), self.metrics.length_after_flush(), self._elapsed())
        assert self.checkpoints is not None
        saved = self.checkpoints.save(snapshot, self.cursor, self.tree.step_counter.total, self._boundary_mark(), force)
        self.display.note_checkpoint(saved, self.checkpoints.auto_interval)
