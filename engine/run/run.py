"""One call of ``Trainer.fit``: build the loops, restore a checkpoint, run, save at boundaries."""

from __future__ import annotations

import time
import warnings
from typing import Any, Iterable, Sequence

import torch

from engine import faults
from engine.loops.tree import Boundaries, LoopTree, build_loops, tbptt_split_length
from engine.callbacks import Callback, RunView
from engine.checkpoint.store import LoadedCheckpoint
from engine.checkpoint.policy import RunCheckpointer
from engine.config import TrainerConfig
from engine.data.position import EpochData
from engine.run.display import Display
from engine.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointIncompatible,
    CheckpointNotFound,
    ModuleContractError,
)
from engine.loops.context import Position, StopState
from engine.loops.stop import split_boundary_stop_reason
from engine.run.metrics_log import MetricsLog
from engine.optim_setup import read_optimizer_setup
from engine.run.preemption import PreemptionWatcher, run_requeue_command
from engine.result import FitResult
from engine.rng import RngSnapshot, capture_global_rng, restore_global_rng
from engine.checkpoint.storage import Storage
from progress import Cursor, ProgressSchemaError, encode_tree

STATE_KEYS = {"signature", "module", "optimizers", "schedulers", "loops", "rng", "callbacks", "metrics_bytes", "elapsed_seconds"}


class FitRun:
    """Everything one ``fit`` call needs; see :meth:`engine.Trainer.fit`."""

    def __init__(self, config: TrainerConfig, callbacks: Sequence[Callback], module: torch.nn.Module,
                 train_data: Iterable[Any], storage: Storage | None) -> None:
        _check_module(module)
        self.config = config
        self.callbacks = list(callbacks)
        self.module = module
        self.setup = read_optimizer_setup(module.configure_optimizers())
        module._engine_optimizers = self.setup.optimizers
        module._engine_schedulers = [s.scheduler for s in self.setup.schedules]
        self.position = Position()
        self.stop = StopState()
        self.data = EpochData(train_data)
        self.tree: LoopTree = build_loops(module, self.setup, config, self.data, self.position, self.stop,
                                          Boundaries(self._split_boundary, self._epoch_boundary))
        self.storage = storage
        self.metrics = MetricsLog(storage)
        self.checkpoints = RunCheckpointer(storage, config.checkpoint, self.metrics) if storage is not None and config.checkpoint else None
        self.preemption = PreemptionWatcher(config.preemption_signals)
        self.view = RunView(self.stop.request)
        self.display = Display(config.progress_bar, config.log_every_seconds, self.data.length, tbptt=self.tree.split is not None)
        self.cursor: Cursor | None = None
        self.resumed_from: str | None = None
        self.resumed_cursor: Cursor | None = None
        self._saved_current_state = False
        self._elapsed_before = 0.0
        self._started = time.monotonic()

    # ---- running ----------------------------------------------------------------------
    def run(self, resume: str) -> FitResult:
        with self.preemption:
            try:
                self._start(resume)
                for callback in self.callbacks:
                    callback.on_fit_start(self.view)
                self.tree.fit.run()
                if self.checkpoints is not None:
                    if not self._saved_current_state:
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
        self.display.finish(self.tree.fit.progress.total.completed, self.tree.step_counter.total, self.stop.reason)
        if not self.stop.requested:
            for callback in self.callbacks:
                callback.on_fit_end(self.view)
        preempted = self.preemption.received is not None and self.stop.reason == self.preemption.reason
        if preempted and self.config.requeue_command:
            run_requeue_command(self.config.requeue_command)
        return FitResult(
            cursor=self.cursor,
            epochs_completed=self.tree.fit.progress.total.completed,
            optimizer_steps=self.tree.step_counter.total,
            stop_reason=self.stop.reason,
            resumed_from=self.resumed_from,
            last_checkpoint=None if self.checkpoints is None else self.checkpoints.last_name,
            progress=self.tree.progress_tree(self.cursor),
            preempted=preempted,
            resumed_cursor=self.resumed_cursor,
        )

    def _start(self, resume: str) -> None:
        if self.checkpoints is not None:
            self.checkpoints.acquire()
        loaded = self._find_checkpoint(resume)
        if loaded is None:
            self.metrics.start_fresh()
        else:
            self._restore(loaded)
            self.resumed_from = loaded.name
            self.resumed_cursor = loaded.progress.cursor
            self._saved_current_state = True
            # A resumed run re-evaluates the split-boundary predicates before doing any work.
            reason = split_boundary_stop_reason(self.tree.step_counter.total, self.config.max_steps,
                                                self._elapsed(), self.config.max_time)
            if reason is not None:
                self.stop.request(reason)
        if self.checkpoints is not None:
            self.checkpoints.start(self.tree.step_counter.total)
        self.display.start(self.config.run_dir, loaded)

    def _elapsed(self) -> float:
        return self._elapsed_before + time.monotonic() - self._started

    # ---- boundaries -------------------------------------------------------------------
    def _split_boundary(self, split_index: int, losses: list[torch.Tensor]) -> None:
        position = self.position
        cursor = self.cursor = Cursor(position.epoch, position.batch, split_index, 0)
        values = [loss.item() for loss in losses]
        steps = self.tree.step_counter.total
        self.metrics.append(cursor, values, steps)
        self.display.update(cursor, values[0], steps)
        view = self.view
        view._cursor, view._losses, view._optimizer_steps = cursor, values, steps
        for callback in self.callbacks:
            callback.on_split_end(view)
        self._saved_current_state = False
        faults.reach("split_end")
        self._check_stop(steps)
        if self.checkpoints is not None:
            self.checkpoints.check()
            if self.stop.requested or self.checkpoints.due(self._units_completed(), steps):
                self._save(force=self.stop.requested)
        faults.reach("split_end_after_checkpoint")

    def _check_stop(self, steps: int) -> None:
        if self.preemption.received is not None:
            self.stop.request(self.preemption.reason)
        reason = split_boundary_stop_reason(steps, self.config.max_steps, self._elapsed(), self.config.max_time)
        if reason is not None:
            self.stop.request(reason)

    def _units_completed(self) -> int:
        loop = self.tree.split if self.tree.split is not None else self.tree.epoch
        return loop.progress.total.completed

    def _epoch_boundary(self, epoch: int) -> None:
        self.display.end_epoch(epoch)
        self.view._epochs_completed = self.tree.fit.progress.total.completed
        self._saved_current_state = False
        for callback in self.callbacks:
            callback.on_epoch_end(self.view)
        faults.reach("epoch_end")
        self._check_stop(self.tree.step_counter.total)
        if self.checkpoints is not None and (self.config.checkpoint.at_epoch_end or self.stop.requested):
            self._save(force=self.stop.requested)

    # ---- saving -----------------------------------------------------------------------
    def _save(self, force: bool = False) -> None:
        steps = self.tree.step_counter.total
        saved = self.checkpoints.save(self._state_tree, encode_tree(self.tree.progress_tree(self.cursor)),
                                      self.cursor, steps, force)
        self._saved_current_state = saved
        self.display.note_checkpoint(saved)

    def _state_tree(self, metrics_bytes: int) -> dict[str, Any]:
        return {
            "signature": self._signature(),
            "module": self.module.state_dict(),
            "optimizers": [optimizer.state_dict() for optimizer in self.setup.optimizers],
            "schedulers": [schedule.scheduler.state_dict() for schedule in self.setup.schedules],
            "loops": self.tree.loop_states(),
            "rng": capture_global_rng().to_state(),
            "callbacks": self._callback_states(),
            "metrics_bytes": metrics_bytes,
            "elapsed_seconds": self._elapsed(),
        }

    def _signature(self) -> dict[str, Any]:
        """What must match between a checkpoint and the run that resumes it."""
        return {
            "tbptt_split_length": tbptt_split_length(self.module),
            "carry_hidden_across_batches": bool(getattr(self.module, "carry_hidden_across_batches", False)),
            "automatic_optimization": bool(getattr(self.module, "automatic_optimization", True)),
            "optimizers": len(self.setup.optimizers),
            "schedulers": len(self.setup.schedules),
            "data_length": self.data.length,
            "accumulate_grad": self.config.accumulate_grad,
            "accumulate_over": self.config.accumulate_over,
        }

    def _callback_states(self) -> dict[str, Any]:
        states = {key: callback.state_dict() for key, callback in self._callbacks_by_key().items()}
        return {key: state for key, state in states.items() if state}

    def _callbacks_by_key(self) -> dict[str, Callback]:
        """Callbacks keyed by class, so their states survive adding or reordering callbacks."""
        keyed: dict[str, Callback] = {}
        for callback in self.callbacks:
            base = f"{type(callback).__module__}.{type(callback).__qualname__}"
            key, count = base, 1
            while key in keyed:
                count += 1
                key = f"{base}#{count}"
            keyed[key] = callback
        return keyed

    # ---- resuming ---------------------------------------------------------------------
    def _restore_callbacks(self, name: str, saved: Any) -> None:
        if not isinstance(saved, dict):
            raise CheckpointCorrupt(f"{name}: the callback states are malformed")
        current = self._callbacks_by_key()
        for key, callback in current.items():
            if key in saved:
                callback.load_state_dict(saved[key])
        dropped = [key for key, state in saved.items() if key not in current and state]
        if dropped:
            warnings.warn(f"{name} holds state for callbacks this run does not have: {dropped}; it is not used", stacklevel=4)

    def _find_checkpoint(self, resume: str) -> LoadedCheckpoint | None:
        if resume == "off":
            return None
        if self.checkpoints is None:
            if resume in ("auto", "off"):
                return None
            raise CheckpointNotFound(f"resume={resume!r} needs TrainerConfig.run_dir and a checkpoint policy")
        if resume not in ("auto", "latest"):
            return self.checkpoints.store.load(resume)
        loaded = self.checkpoints.store.latest()
        if loaded is not None:
            return loaded
        existing = self.checkpoints.store.committed_names()
        if existing:
            raise CheckpointCorrupt(
                f"{len(existing)} checkpoint(s) in {self.storage.url} and none verifies; "
                "refusing to start over silently (pass resume='off' to start a fresh run)"
            )
        if resume == "latest":
            raise CheckpointNotFound(f"resume='latest' but {self.storage.url} holds no checkpoint")
        return None

    def _restore(self, loaded: LoadedCheckpoint) -> None:
        state = loaded.state
        if not isinstance(state, dict) or set(state) != STATE_KEYS:
            raise CheckpointCorrupt(f"{loaded.name}: the state tree does not have the keys {sorted(STATE_KEYS)}")
        _compare_signature(loaded.name, state["signature"], self._signature())
        _check_module_state(loaded.name, self.module, state["module"])
        try:
            self.module.load_state_dict(state["module"], strict=True)
            for optimizer, optimizer_state in zip(self.setup.optimizers, state["optimizers"], strict=True):
                optimizer.load_state_dict(optimizer_state)
            for schedule, scheduler_state in zip(self.setup.schedules, state["schedulers"], strict=True):
                schedule.scheduler.load_state_dict(scheduler_state)
            self.tree.load_progress(loaded.progress)
            self.tree.load_loop_states(state["loops"])
            self._restore_callbacks(loaded.name, state["callbacks"])
            rng = RngSnapshot.from_state(state["rng"])
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, ProgressSchemaError) as error:
            raise CheckpointIncompatible(f"{loaded.name}: cannot restore this run from it: {type(error).__name__}: {error}") from error
        self.metrics.resume_at(int(state["metrics_bytes"]))
        self._elapsed_before = float(state["elapsed_seconds"])
        self.cursor = loaded.progress.cursor
        self.view._cursor = self.cursor
        self.view._optimizer_steps = self.tree.step_counter.total
        self.view._epochs_completed = self.tree.fit.progress.total.completed
        restore_global_rng(rng)


def _check_module(module: Any) -> None:
    if not isinstance(module, torch.nn.Module):
        raise ModuleContractError(f"fit expects a torch.nn.Module (subclass engine.Module), got {type(module).__name__}")
    for method in ("training_step", "configure_optimizers"):
        if not callable(getattr(module, method, None)):
            raise ModuleContractError(f"{type(module).__name__} has no {method}() method (subclass engine.Module)")


def _compare_signature(name: str, saved: Any, current: dict[str, Any]) -> None:
    if not isinstance(saved, dict):
        raise CheckpointCorrupt(f"{name}: the run signature is malformed")
    differences = [f"{key}: checkpoint {saved.get(key)!r}, this run {value!r}"
                   for key, value in current.items() if saved.get(key) != value]
    if differences:
        raise CheckpointIncompatible(f"{name} was written by a different run setup: " + "; ".join(differences))


def _check_module_state(name: str, module: torch.nn.Module, saved: Any) -> None:
    if not isinstance(saved, dict):
        raise CheckpointCorrupt(f"{name}: the module state is malformed")
    current = module.state_dict()
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    if missing or unexpected:
        raise CheckpointIncompatible(f"{name}: model keys differ: missing from checkpoint {missing}, not in model {unexpected}")
    for key, tensor in current.items():
        other = saved[key]
        if not isinstance(other, torch.Tensor) or other.shape != tensor.shape or other.dtype != tensor.dtype:
            shape = tuple(other.shape) if isinstance(other, torch.Tensor) else type(other).__name__
            raise CheckpointIncompatible(f"{name}: model entry {key!r} is {shape} in the checkpoint, {tuple(tensor.shape)} {tensor.dtype} in the model")
