"""Compose the loop tree from the module's and the trainer's configuration.

This is the one place that reads feature flags (TBPTT, several optimizers, manual
optimization, accumulation, clipping, precision, device)::

    tbptt, several optimizers, automatic:  Fit -> Epoch -> Split -> Optimizer -> AutomaticFlow
    no tbptt, several optimizers:          Fit -> Epoch -> Optimizer -> AutomaticFlow
    no tbptt, one optimizer:               Fit -> Epoch -> AutomaticFlow
    manual optimization:                   Fit -> Epoch [-> Split] -> ManualFlow

Between the epoch loop and the level below, :class:`~engine.loops.device.OnDevice` moves each batch
to the run's device; the flow runs the step inside the run's
:class:`~engine.loops.precision.Precision`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable, Sequence

import torch

from engine.config import TrainerConfig
from engine.data.position import EpochData
from engine.data.workers import PreemptionSafeLoader
from engine.distributed.agreement import agree_on_anomaly
from engine.distributed.data_parallel import DataParallelStep
from engine.distributed.sharded import ShardedStep, as_root_forward, is_sharded_module
from engine.distributed.environment import DistributedContext
from engine.distributed.rank_values import LockstepRanks, RankExchange
from engine.distributed.sampler import shard_validation_loader
from engine.errors import ConfigError, ModuleContractError
from engine.loops.anomaly import AnomalyHistory, AnomalyWatch, NoAnomalyWatch, make_anomaly_watch
from engine.loops.contracts import Losses
from engine.loops.context import Position, StopState
from engine.loops.epoch import EpochLoop
from engine.loops.evaluation import EvaluationLoop, Ranks
from engine.loops.fit import FitLoop
from engine.loops.flows import AutomaticFlow, ManualFlow, StepCounter
from engine.loops.optimizer import OptimizerLoop, SingleOptimizer
from engine.loops.precision import Precision, make_precision
from engine.loops.split import SplitLoop, WholeBatch
from engine.loops.step_output import make_step_call, read_plain_output, read_tbptt_output
from engine.data.splitting import split_along_time
from engine.loops.optim_setup import OptimizerSetup
from engine.loops.compiled import training_step_of
from engine.loops.device import OnDevice, move_to_device
from engine.loops.logged import MetricLogger
from engine.loops.monitored import AgreeValues, MonitoredSchedules
from engine.distributed import mean_losses
from progress import ProgressTree


@dataclasses.dataclass
class Boundaries:
    """What the loops call at their boundaries (metrics, callbacks, stop checks, checkpoints)."""

    split: Callable[[int, Losses], None]
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
    device: torch.device
    precision: Precision
    logger: MetricLogger
    evaluation: EvaluationLoop | None = None
    monitored: MonitoredSchedules = dataclasses.field(default_factory=lambda: MonitoredSchedules([]))
    watch: AnomalyWatch | NoAnomalyWatch = dataclasses.field(default_factory=NoAnomalyWatch)

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
        if self.evaluation is not None:
            records["evaluation.validations"] = self.evaluation.progress
            records["evaluation.batches"] = self.evaluation.batches
        return ProgressTree(records=records, cursor=cursor, anomalies=list(self.epoch.anomalies.records))

    def units_completed(self) -> int:
        """Units of step work completed over the run: splits with TBPTT, batches without."""
        loop = self.split if self.split is not None else self.epoch
        return loop.progress.total.completed

    def load_progress(self, tree: ProgressTree) -> None:
        """Adopt the counts of ``tree`` (rolled back to what was completed)."""
        mine = self.progress_tree().records
        if set(tree.records) != set(mine):
            raise ValueError(f"progress records differ: checkpoint has {sorted(tree.records)}, this run {sorted(mine)}")
        for name, record in mine.items():
            saved = tree.records[name]
            saved.reset_on_restart()
            record.total, record.current = saved.total, saved.current
        self.epoch.anomalies.load(tree.anomalies)

    def loop_states(self) -> dict[str, Any]:
        return {
            "flow": self.flow.state_dict(),
            "split": None if self.split is None else self.split.state_dict(),
            "data": self.data.state_dict(),
            "logged": self.logger.state_dict(),
            "evaluation": None if self.evaluation is None else self.evaluation.state_dict(),
        }

    def load_loop_states(self, states: dict[str, Any]) -> None:
        self.flow.load_state_dict(states["flow"])
        if self.split is not None:
            # Hidden state goes to this run's device, whichever device wrote it.
            self.split.load_state_dict(move_to_device(states["split"], self.device))
        self.data.load_state_dict(states["data"])
        self.logger.load_state_dict(states["logged"])
        if self.evaluation is not None:
            if states["evaluation"] is None:
                raise ValueError("the checkpoint was written by a run without validation data")
            self.evaluation.load_state_dict(states["evaluation"])

    def close(self) -> None:
        self.step_counter.close()
        self.watch.close()
        if self.evaluation is not None:
            self.evaluation.close()


def units_completed_in(progress: ProgressTree) -> int:
    """:meth:`LoopTree.units_completed` as a progress tree (a checkpoint's) records it."""
    record = progress.records.get("split.splits") or progress.records["epoch.batches"]
    return record.total.completed


def tbptt_split_length(module: torch.nn.Module) -> int | None:
    """The module's split length, validated."""
    length = getattr(module, "tbptt_split_length", None)
    if length is None:
        return None
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise ConfigError(f"{type(module).__name__}.tbptt_split_length: expected a positive int or None, got {length!r}")
    return length


def module_flag(module: torch.nn.Module, name: str, default: bool) -> bool:
    """The module's boolean attribute ``name``, validated (a 0, 1 or "no" is refused, not read as a flag)."""
    value = getattr(module, name, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{type(module).__name__}.{name}: expected True or False, got {value!r}")
    return value


def build_loops(
    module: torch.nn.Module,
    setup: OptimizerSetup,
    config: TrainerConfig,
    data: EpochData,
    position: Position,
    stop: StopState,
    boundaries: Boundaries,
    device: torch.device,
    logger: MetricLogger,
    val_data: Iterable[Any] | None = None,
    distributed: DistributedContext | None = None,
    *,
    own: torch.nn.Module,
) -> LoopTree:
    """Compose the loops; ``module`` is the user's module (possibly ``torch.compile``d) and
    already on ``device``; ``own`` is the module it wraps (:func:`original_module`, unwrapped
    once by the caller): its attributes and parameters, the sharded root, DDP's module."""
    split_length = tbptt_split_length(module)
    tbptt = split_length is not None
    carry = module_flag(module, "carry_hidden_across_batches", False)
    if carry and not tbptt:
        raise ConfigError(
            f"{type(module).__name__}.carry_hidden_across_batches is True but tbptt_split_length is None; "
            "hidden state exists only with TBPTT"
        )
    automatic = module_flag(module, "automatic_optimization", True)
    several = automatic and len(setup.optimizers) > 1
    step = training_step_of(module, own)
    gradient_sync: DataParallelStep | ShardedStep | None = None
    sharded = is_sharded_module(own)  # also on a one-rank mesh in one process
    if sharded:
        gradient_sync = ShardedStep(own, step)  # FSDP2 syncs in its own backward
        step = gradient_sync.step  # each step is the root's forward, so its hooks gather and reduce
    elif distributed is not None:
        gradient_sync = DataParallelStep(own, step, distributed)
        step = gradient_sync.step  # each step is a DDP forward, so its backward syncs gradients
    call_step = make_step_call(step, tbptt, several, position)
    read_output = read_tbptt_output if tbptt else read_plain_output
    parameters = list(module.parameters())
    precision = make_precision(config.precision, device)
    step_counter = StepCounter(setup.optimizers)
    if config.anomaly is not None and not automatic:
        raise ConfigError("TrainerConfig.anomaly: Rollback needs automatic optimization (the engine must check the "
                          "loss before backward and the gradients before the step); with automatic_optimization = "
                          "False, set anomaly=None")
    agree = None if distributed is None else functools.partial(agree_on_anomaly, distributed)
    watch = make_anomaly_watch(config.anomaly, position, setup.optimizers, config.precision, agree)
    if automatic:
        flow: AutomaticFlow | ManualFlow = AutomaticFlow(
            call_step, read_output, setup, parameters, config.accumulate_grad,
            config.accumulate_over == "splits", _clipper(config), precision, step_counter, gradient_sync, watch,
        )
    else:
        if config.accumulate_grad != 1 or config.gradient_clip_val is not None:
            raise ConfigError(
                "TrainerConfig.accumulate_grad / gradient_clip_val apply to automatic optimization only; "
                "with automatic_optimization = False the step accumulates and clips itself"
            )
        flow = ManualFlow(call_step, read_output, parameters, precision)
    optimizer_loop = OptimizerLoop(flow, len(setup.optimizers)) if several else None
    runner = optimizer_loop if optimizer_loop is not None else SingleOptimizer(flow)
    if split_length is not None:
        split_loop = SplitLoop(_splitter(module), split_length, carry, runner, position, stop, boundaries.split)
        epoch_loop = EpochLoop(data, OnDevice(split_loop, device), position, stop, batch_boundary=None)
    else:
        split_loop = None
        epoch_loop = EpochLoop(data, OnDevice(WholeBatch(runner), device), position, stop,
                               batch_boundary=boundaries.split)
    fit_loop = FitLoop(epoch_loop, config.max_epochs, position, stop, boundaries.epoch)
    evaluation = None
    if val_data is not None:
        ranks: Ranks | None = None
        if distributed is not None and sharded:
            ranks = LockstepRanks(RankExchange(distributed))  # each FSDP2 forward is a collective
        elif distributed is not None:
            ranks = RankExchange(distributed)
            if config.distributed_sampler:
                val_data = shard_validation_loader(val_data, distributed, one_sequence=carry)
        # Its workers outlive a preemption signal (the pass finishes before the stop's commit).
        safe_val_data = PreemptionSafeLoader(val_data, config.preemption_signals, seed_samples=True)
        evaluation = _evaluation_loop(module, safe_val_data, split_length, carry, logger, device, precision, ranks,
                                      own if sharded else None)
    monitored = MonitoredSchedules(setup.schedules if automatic else [], _agree_values(distributed))
    return LoopTree(fit_loop, epoch_loop, split_loop, optimizer_loop, flow, step_counter, data, device, precision,
                    logger, evaluation, monitored, watch)


def _agree_values(distributed: DistributedContext | None) -> AgreeValues:
    """Monitored values as the mean over the ranks (each rank logs its own training metrics),
    so every replica steps its schedulers alike."""
    if distributed is None:
        return lambda values: values
    return lambda values: mean_losses(distributed, values)[0]


def _evaluation_loop(module: torch.nn.Module, val_data: PreemptionSafeLoader, split_length: int | None, carry: bool,
                     logger: MetricLogger, device: torch.device, precision: Precision,
                     ranks: Ranks | None, sharded: torch.nn.Module | None) -> EvaluationLoop:
    """``sharded``: the FSDP2 root module the step runs as the forward of (None: not sharded)."""
    step = getattr(module, "validation_step", None)
    if not callable(step):
        raise ModuleContractError(f"{type(module).__name__} has no validation_step(); it is needed when val_data is given")
    if sharded is not None:
        step = as_root_forward(sharded, step)
    if split_length is None:
        call: Callable[[Any, Any], Any] = _on_device(lambda batch, hidden: step(batch), device, precision)
        return EvaluationLoop(module, val_data, call, None, None, carry, logger, ranks)
    return EvaluationLoop(module, val_data, _on_device(lambda batch, hidden: step(batch, hidden=hidden), device, precision),
                          _splitter(module), split_length, carry, logger, ranks)


def _on_device(call: Callable[[Any, Any], Any], device: torch.device, precision: Precision) -> Callable[[Any, Any], Any]:
    """The validation step on the run's device (each batch or split moved there) and under its
    autocast."""
    def run(batch: Any, hidden: Any) -> Any:
        with precision.autocast():
            return call(move_to_device(batch, device), hidden)
    return run


def _splitter(module: torch.nn.Module) -> Callable[[Any, int], Sequence[Any]]:
    """The module's ``split_batch``, or the default cut along ``tbptt_time_dim`` for a plain
    nn.Module that does not subclass engine.Module."""
    time_dim = getattr(module, "tbptt_time_dim", 1)
    if isinstance(time_dim, bool) or not isinstance(time_dim, int):
        raise ConfigError(f"{type(module).__name__}.tbptt_time_dim: expected the int index of the time dimension "
                          f"(1 for batch-first tensors, 0 for time-first), got {time_dim!r}")
    custom = getattr(module, "split_batch", None)
    if callable(custom):
        return custom
    return lambda batch, length: split_along_time(batch, length, time_dim)


def _clipper(config: TrainerConfig) -> Callable[[list[torch.nn.Parameter]], object] | None:
    value = config.gradient_clip_val
    if value is None:
        return None
    if config.gradient_clip_algorithm == "norm":
        return lambda parameters: torch.nn.utils.clip_grad_norm_(parameters, value)
    return lambda parameters: torch.nn.utils.clip_grad_value_(parameters, value)
