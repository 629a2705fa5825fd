"""Compose the loop tree from the module's and the trainer's configuration.

This is the one place that reads feature flags (TBPTT, several optimizers, manual
optimization, accumulation, clipping)::

    tbptt, several optimizers, automatic:  Fit -> Epoch -> Split -> Optimizer -> AutomaticFlow
    no tbptt, several optimizers:          Fit -> Epoch -> Optimizer -> AutomaticFlow
    no tbptt, one optimizer:               Fit -> Epoch -> AutomaticFlow
    manual optimization:                   Fit -> Epoch [-> Split] -> ManualFlow
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from engine.config import TrainerConfig
from engine.data.position import EpochData
from engine.errors import ConfigError
from engine.loops.context import Position, StopState
from engine.loops.epoch import EpochLoop
from engine.loops.fit import FitLoop
from engine.loops.flows import AutomaticFlow, ManualFlow, StepCounter
from engine.loops.optimizer import OptimizerLoop, SingleOptimizer
from engine.loops.split import SplitLoop, WholeBatch
from engine.loops.step_output import make_step_call, read_plain_output, read_tbptt_output
from engine.module import Module
from engine.optim_setup import OptimizerSetup
from progress import ProgressTree


@dataclasses.dataclass
class Boundaries:
    """What the loops call at their boundaries (metrics, callbacks, stop checks, checkpoints)."""

    split: Callable[[int, list], None]
    epoch: Callable[[int], None]


@dataclasses.dataclass
class LoopTree:
    fit: FitLoop
    epoch: EpochLoop
    split: SplitLoop | None
    optimizer: OptimizerLoop | None
    flow: AutomaticFlow | ManualFlow
    step_counter: StepCounter
    data: EpochData

    def progress_tree(self, cursor: Any = None) -> ProgressTree:
        records = {
            "fit.epochs": self.fit.progress,
            "epoch.batches": self.epoch.progress,
            "flow.optimizer_steps": self.step_counter.progress,
        }
        if self.split is not None:
            records["split.splits"] = self.split.progress
        if self.optimizer is not None:
            records["optimizer.optimizers"] = self.optimizer.progress
        return ProgressTree(records=records, cursor=cursor)

    def load_progress(self, tree: ProgressTree) -> None:
        """Adopt the counts of ``tree`` (rolled back to what was completed)."""
        mine = self.progress_tree().records
        if set(tree.records) != set(mine):
            raise ValueError(f"progress records differ: checkpoint has {sorted(tree.records)}, this run {sorted(mine)}")
        for name, record in mine.items():
            saved = tree.records[name]
            saved.reset_on_restart()
            record.total, record.current = saved.total, saved.current

    def loop_states(self) -> dict[str, Any]:
        return {
            "flow": self.flow.state_dict(),
            "split": None if self.split is None else self.split.state_dict(),
            "data": self.data.state_dict(),
        }

    def load_loop_states(self, states: dict[str, Any]) -> None:
        self.flow.load_state_dict(states["flow"])
        if self.split is not None:
            self.split.load_state_dict(states["split"])
        self.data.load_state_dict(states["data"])

    def close(self) -> None:
        self.step_counter.close()


def tbptt_split_length(module: Module) -> int | None:
    """The module's split length, validated."""
    length = getattr(module, "tbptt_split_length", None)
    if length is None:
        return None
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise ConfigError(f"{type(module).__name__}.tbptt_split_length: expected a positive int or None, got {length!r}")
    return length


def build_loops(
    module: Module,
    setup: OptimizerSetup,
    config: TrainerConfig,
    data: EpochData,
    position: Position,
    stop: StopState,
    boundaries: Boundaries,
) -> LoopTree:
    split_length = tbptt_split_length(module)
    tbptt = split_length is not None
    carry = bool(getattr(module, "carry_hidden_across_batches", False))
    if carry and not tbptt:
        raise ConfigError(
            f"{type(module).__name__}.carry_hidden_across_batches is True but tbptt_split_length is None; "
            "hidden state exists only with TBPTT"
        )
    automatic = bool(getattr(module, "automatic_optimization", True))
    several = automatic and len(setup.optimizers) > 1
    call_step = make_step_call(module.training_step, tbptt, several, position)
    read_output = read_tbptt_output if tbptt else read_plain_output
    parameters = list(module.parameters())
    if automatic:
        flow: AutomaticFlow | ManualFlow = AutomaticFlow(
            call_step, read_output, setup, parameters, config.accumulate_grad,
            config.accumulate_over == "splits", _clipper(config),
        )
    else:
        if config.accumulate_grad != 1 or config.gradient_clip_val is not None:
            raise ConfigError(
                "TrainerConfig.accumulate_grad / gradient_clip_val apply to automatic optimization only; "
                "with automatic_optimization = False the step accumulates and clips itself"
            )
        flow = ManualFlow(call_step, read_output, parameters)
    optimizer_loop = OptimizerLoop(flow, len(setup.optimizers)) if several else None
    runner = optimizer_loop if optimizer_loop is not None else SingleOptimizer(flow)
    if tbptt:
        split_loop = SplitLoop(module.split_batch, split_length, carry, runner, position, stop, boundaries.split)
        epoch_loop = EpochLoop(data, split_loop, position, stop, batch_boundary=None)
    else:
        split_loop = None
        epoch_loop = EpochLoop(data, WholeBatch(runner), position, stop, batch_boundary=boundaries.split)
    fit_loop = FitLoop(epoch_loop, flow, config.max_epochs, position, stop, boundaries.epoch)
    return LoopTree(fit_loop, epoch_loop, split_loop, optimizer_loop, flow, StepCounter(setup.optimizers), data)


def _clipper(config: TrainerConfig) -> Callable[[list[torch.nn.Parameter]], object] | None:
    value = config.gradient_clip_val
    if value is None:
        return None
    if config.gradient_clip_algorithm == "norm":
        return lambda parameters: torch.nn.utils.clip_grad_norm_(parameters, value)
    return lambda parameters: torch.nn.utils.clip_grad_value_(parameters, value)
