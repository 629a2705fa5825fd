"""Flows: the innermost piece, which calls the user's step for one split and one optimizer.

``AutomaticFlow``: zero_grad (at the start of an accumulation window), the step, backward of the
loss divided by the window size, then at the end of the window: clip, ``optimizer.step()``,
step-interval LR schedulers. ``ManualFlow``: the step does its own backward and steps.

Both count optimizer steps through ``Optimizer.register_step_pre_hook`` /
``register_step_post_hook``, so manual optimization keeps exact progress with no bookkeeping
in the user's code.

Both run the step inside the run's :class:`~engine.loops.precision.Precision` (autocast). With
"16-mixed", a step whose gradients hold inf/nan is skipped by the gradient scaler: it does not
call ``optimizer.step()``, so it is not counted. ``optimizer_steps`` (and ``max_steps``,
``every_n_steps``) count *applied* steps; step-interval LR schedulers step only after an applied
step (the schedule follows the parameters' updates); skipped steps are counted apart
(``AutomaticFlow.skipped_steps``, saved in the flow state).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Protocol

import torch

from engine import faults, watchdog
from engine.errors import ModuleContractError
from engine.loops.anomaly import AnomalyWatch, NoAnomalyWatch
from engine.loops.precision import Precision
from engine.loops.step_output import Hidden, StepCall
from engine.loops.optim_setup import OptimizerSetup
from progress import Progress

ReadOutput = Callable[[Any], "tuple[torch.Tensor, Hidden]"]


class GradientSync(Protocol):
    """How a distributed run syncs gradients (engine.distributed.data_parallel)."""

    def set_will_step(self, will_step: bool) -> None: ...

    def sync_open_window(self, parameters: list[torch.nn.Parameter]) -> None: ...


class StepCounter:
    """Counts optimizer steps (ready/started before ``step()``, processed/completed after)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.progress = Progress()
        self._handles = []
        for optimizer in optimizers:
            self._handles.append(optimizer.register_step_pre_hook(self._before_step))
            self._handles.append(optimizer.register_step_post_hook(self._after_step))

    def _before_step(self, optimizer: object, args: object, kwargs: object) -> None:
        self.progress.increment_ready()
        self.progress.increment_started()

    def _after_step(self, optimizer: object, args: object, kwargs: object) -> None:
        self.progress.increment_processed()
        self.progress.increment_completed()
        faults.reach("after_optimizer_step")

    @property
    def total(self) -> int:
        return self.progress.total.completed

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _gradients_state(parameters: list[torch.nn.Parameter]) -> dict[int, torch.Tensor]:
    return {index: p.grad for index, p in enumerate(parameters) if p.grad is not None}


def _load_gradients(parameters: list[torch.nn.Parameter], grads: dict[int, torch.Tensor]) -> None:
    for index, parameter in enumerate(parameters):
        grad = grads.get(index)
        parameter.grad = None if grad is None else grad.to(parameter.device).clone()


class AutomaticFlow:
    """zero_grad / step / backward / clip / optimizer.step / scheduler.step, with accumulation."""

    def __init__(
        self,
        call_step: StepCall,
        read_output: ReadOutput,
        setup: OptimizerSetup,
        parameters: list[torch.nn.Parameter],
        accumulate: int,
        accumulate_over_splits: bool,
        clip: Callable[[list[torch.nn.Parameter]], object] | None,
        precision: Precision,
        step_counter: StepCounter,
        gradient_sync: GradientSync | None = None,
        watch: AnomalyWatch | NoAnomalyWatch | None = None,
    ) -> None:
        self._call_step = call_step
        self._watch = watch if watch is not None else NoAnomalyWatch()
        self._gradient_sync = gradient_sync
        self._precision = precision
        self._step_counter = step_counter
        self._read_output = read_output
        self._optimizers = setup.optimizers
        self._last_index = len(setup.optimizers) - 1
        # Monitored schedules are stepped at the run's boundaries, with a metric (engine.loops.monitored).
        stepped_here = [s for s in setup.schedules if not s.monitored]
        self._step_schedulers = [
            [s.scheduler for s in stepped_here if s.interval == "step" and s.scheduler.optimizer is o]
            for o in setup.optimizers
        ]
        self._epoch_schedulers = [s.scheduler for s in stepped_here if s.interval == "epoch"]
        self._optimizer_parameters = [
            [p for group in o.param_groups for p in group["params"]] for o in setup.optimizers
        ]
        self._parameters = parameters
        self._accumulate = accumulate
        self._per_split = accumulate_over_splits
        self._clip = clip
        # Accumulation state (saved in checkpoints).
        self.needs_zero_grad = [True] * len(setup.optimizers)
        self.pending_backward = [False] * len(setup.optimizers)
        self.units_since_step = 0
        self.skipped_steps = 0

    def run(self, batch: Any, hidden: Hidden, optimizer_index: int, last_split: bool) -> tuple[torch.Tensor, Hidden]:
        optimizer = self._optimizers[optimizer_index]
        if self.needs_zero_grad[optimizer_index]:
            optimizer.zero_grad()
            self.needs_zero_grad[optimizer_index] = False
        watchdog.mark(watchdog.STEP)
        faults.reach("step_start")
        unit_ends = last_split or self._per_split
        window_full = unit_ends and self.units_since_step + 1 >= self._accumulate
        if self._gradient_sync is not None:
            self._gradient_sync.set_will_step(window_full)
        with self._precision.autocast():
            loss, new_hidden = self._read_output(self._call_step(batch, hidden, optimizer_index))
        if not loss.requires_grad:
            raise ModuleContractError(
                "the loss returned by training_step does not require grad, so backward cannot reach any parameter: "
                "it was computed without the module's trainable parameters (under torch.no_grad(), from .detach() "
                "or .item(), or from a new tensor); return the loss computed from the model's output")
        self._watch.check_loss(loss, optimizer_index)  # before backward: a bad loss reaches no gradient
        watchdog.mark(watchdog.BACKWARD)
        self._precision.backward(loss / self._accumulate if self._accumulate > 1 else loss)
        faults.reach("after_backward")
        self.pending_backward[optimizer_index] = True
        if window_full:
            self._step(optimizer_index)
        if unit_ends and optimizer_index == self._last_index:
            self.units_since_step = 0 if window_full else self.units_since_step + 1
            if window_full:
                # Once every optimizer of the window has stepped: the scale the next window's
                # gradients are scaled by changes only here.
                self._precision.update()
        return loss.detach(), new_hidden

    def _step(self, index: int) -> None:
        optimizer = self._optimizers[index]
        if self._clip is not None:
            self._precision.unscale(optimizer)
            self._clip(self._optimizer_parameters[index])
        applied_before = self._step_counter.total
        watchdog.mark(watchdog.OPTIMIZER)
        self._precision.step(optimizer)
        if self._step_counter.total != applied_before:
            for scheduler in self._step_schedulers[index]:
                scheduler.step()
        else:
            self.skipped_steps += 1
        self.needs_zero_grad[index] = True
        self.pending_backward[index] = False

    def end_epoch(self) -> None:
        """Step a window left open by the end of the data, then epoch-interval schedulers."""
        stepped = False
        if self._gradient_sync is not None and any(self.pending_backward):
            self._gradient_sync.sync_open_window(self._parameters)
        for index, pending in enumerate(self.pending_backward):
            if pending:
                self._step(index)
                stepped = True
        if stepped:
            self._precision.update()
        self.units_since_step = 0
        with warnings.catch_warnings():
            # After a resume at the very end of an epoch, no optimizer.step() has run in this
            # process yet; torch's order check would warn although the order is right.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            for scheduler in self._epoch_schedulers:
                scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        pending = any(self.pending_backward)
        return {
            "needs_zero_grad": list(self.needs_zero_grad),
            "pending_backward": list(self.pending_backward),
            "units_since_step": self.units_since_step,
            "skipped_steps": self.skipped_steps,
            # Gradients matter only inside an open accumulation window. With "16-mixed" they
            # are scaled by the scaler's current scale, saved beside them in "precision".
            "gradients": _gradients_state(self._parameters) if pending else {},
            "precision": self._precision.state_dict(),
            "anomaly": self._watch.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._watch.load_state_dict(state.get("anomaly", {}))  # checkpoints of earlier versions lack it
        self.needs_zero_grad = list(state["needs_zero_grad"])
        self.pending_backward = list(state["pending_backward"])
        self.units_since_step = int(state["units_since_step"])
        self.skipped_steps = int(state["skipped_steps"])
        self._precision.load_state_dict(state["precision"])
        if any(self.pending_backward):
            _load_gradients(self._parameters, state["gradients"])


class ManualFlow:
    """Calls the step, which runs backward and ``optimizer.step()`` itself (through
    ``Module.manual_backward`` / ``manual_step`` when a gradient scaler is active)."""

    def __init__(self, call_step: StepCall, read_output: ReadOutput, parameters: list[torch.nn.Parameter],
                 precision: Precision) -> None:
        self._call_step = call_step
        self._read_output = read_output
        self._parameters = parameters
        self._precision = precision

    def run(self, batch: Any, hidden: Hidden, optimizer_index: int, last_split: bool) -> tuple[torch.Tensor, Hidden]:
        watchdog.mark(watchdog.STEP)
        faults.reach("step_start")
        with self._precision.autocast():
            loss, new_hidden = self._read_output(self._call_step(batch, hidden, optimizer_index))
        return loss.detach(), new_hidden

    def end_epoch(self) -> None:
        """Manual optimization steps its own schedulers."""

    def state_dict(self) -> dict[str, Any]:
        # The user may accumulate gradients across splits: keep whatever is there (with the
        # scale they were scaled by, under "16-mixed").
        return {"gradients": _gradients_state(self._parameters), "precision": self._precision.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._precision.load_state_dict(state["precision"])
        _load_gradients(self._parameters, state["gradients"])
