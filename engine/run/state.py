"""What a checkpoint holds: the run state tree, the run signature, capture, validation and
restore. This is the one place that knows the tree (its top-level keys are declared in
engine.checkpoint.format.state_keys, which the distributed commit imports too)::

    {
      "signature":       what must match between a checkpoint and the run resuming it
      "module":          the model's state_dict (keys without torch.compile's "_orig_mod.")
      "optimizers":      [optimizer.state_dict(), ...]
      "schedulers":      [scheduler.state_dict(), ...]
      "loops":           {"flow", "split", "data", "logged", "evaluation"}  (LoopTree.loop_states)
      "rng":             every global random stream (engine.data.rng)
      "envelope":        the settings that change numerics (engine.run.envelope); a resume
                         under other settings warns, naming each difference
      "callbacks":       {callback key: callback.state_dict()}      (non-empty states only)
      "metrics_bytes":   length of metrics.jsonl this checkpoint commits
      "elapsed_seconds": training time so far, over every resumed process
    }

The progress tree (counters and cursor) travels beside it in the checkpoint's own file; both are
produced by :func:`capture` as one :class:`RunSnapshot` and given back to :func:`restore`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import torch

from engine.callbacks import Callback
from engine.checkpoint.format.codec import check_storable
from engine.checkpoint.format.state_keys import (CALLBACKS, ELAPSED_SECONDS, ENVELOPE, LOOPS, METRICS_BYTES, MODULE, OPTIMIZERS,
                                                 RNG, SCHEDULERS, SIGNATURE, STATE_KEYS)
from engine.config import TrainerConfig
from engine.data.hf_shuffle import REMEDY as SHUFFLE_BUFFER_REMEDY, STATE_KEY as SHUFFLE_BUFFER_KEY, check_saved_buffers
from engine.checkpoint.format.shards import TensorShard
from engine.distributed.sharded import is_sharded_module, live_shards
from engine.distributed.state_parts import SHARDED, WORLD_SIZE, check_world_size, is_sharded
from engine.distributed import global_order
from engine.errors import (CheckpointCorrupt, CheckpointError, CheckpointIncompatible, CheckpointWriteError, DataError,
                           warn as warn_user)
from engine.loops.tree import LoopTree, tbptt_split_length
from engine.loops.optim_setup import OptimizerSetup
from engine.data.rng import RngSnapshot, capture_global_rng, check_generator_state, restore_global_rng
from engine.loops.compiled import live_keys, plain_state
from engine.run.envelope import capture_envelope, check_envelope_shape, warn_on_envelope_change
from engine.run.overrides import BuiltSettings, built_settings
from progress import ProgressSchemaError, ProgressTree, encode_tree

LOOP_KEYS = frozenset({"flow", "split", "data", "logged", "evaluation"})
# What two runs must agree on, bit for bit, to be the same run (the signature says how they were
# set up, elapsed_seconds is wall time and the envelope describes the machine: none is compared).
# Signature entries that checkpoints of earlier versions lack: compared only when the checkpoint has them.
NEWER_SIGNATURE_KEYS = frozenset({"batch_size", "optimizer_classes", global_order.GLOBAL_BATCH})
COMPARED_KEYS = (MODULE, OPTIMIZERS, SCHEDULERS, LOOPS, RNG, CALLBACKS, METRICS_BYTES)


@dataclasses.dataclass
class RunParts:
    """The live objects of one fit whose state a checkpoint captures."""

    module: torch.nn.Module
    setup: OptimizerSetup
    tree: LoopTree
    callbacks: Sequence[Callback]
    config: TrainerConfig
    world_size: int = 1  # processes of a distributed run (engine.distributed)
    rank: int = 0  # this process's rank in it
    # Whether the module's parameters are DTensors, read at the first signature: a fit's module
    # is sharded before the fit or never (its loop tree picks its step by it once, too), and
    # reading it walks every parameter, at every checkpoint.
    _sharded: bool | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def signature(self) -> dict[str, Any]:
        """What must match between a checkpoint and the run that resumes it."""
        module, config = self.module, self.config
        return {
            "tbptt_split_length": tbptt_split_length(module),
            "carry_hidden_across_batches": bool(getattr(module, "carry_hidden_across_batches", False)),
            "automatic_optimization": bool(getattr(module, "automatic_optimization", True)),
            "optimizers": len(self.setup.optimizers),
            "schedulers": len(self.setup.schedules),
            "data_length": self.tree.data.length,
            "batch_size": getattr(self.tree.data.loader, "batch_size", None),
            "optimizer_classes": [type(optimizer).__qualname__ for optimizer in self.setup.optimizers],
            "accumulate_grad": config.accumulate_grad,
            "accumulate_over": config.accumulate_over,
            "precision": config.precision,
            "validation": self.tree.evaluation is not None,
            # Only a distributed run records it, so single-process checkpoints stay as they were.
            **global_order.order_signature(self.tree.data.source, self.world_size),
            # Only a sharded (FSDP2) run records it: its module and optimizers are saved per rank.
            **({SHARDED: True} if self._sharded_module() else {}),
        }

    def _sharded_module(self) -> bool:
        if self._sharded is None:
            self._sharded = is_sharded_module(self.module)
        return self._sharded

    def callbacks_by_key(self) -> dict[str, Callback]:
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


@dataclasses.dataclass
class RunSnapshot:
    """One checkpoint's content before encoding: the state tree and the encoded progress; and
    what its commit publishes (:attr:`metrics_bytes`)."""

    state: dict[str, Any]
    progress_bytes: bytes
    progress: ProgressTree

    @property
    def metrics_bytes(self) -> int:
        """What the checkpoint publishes besides itself: the length ``metrics.jsonl`` has once
        the lines it counts are appended (the metrics log sealed them when it was captured)."""
        return int(self.state[METRICS_BYTES])

    @property
    def anchor(self) -> bool:
        """Whether the checkpoint can be resumed on another world size (its manifest says so,
        for retention and the resume choice: engine.distributed.global_order.is_anchor)."""
        return global_order.is_anchor(self.state)


@dataclasses.dataclass
class RestoredRun:
    """What the run itself takes back from a checkpoint after :func:`restore`."""

    metrics_bytes: int
    elapsed_seconds: float
    # The optimizer / scheduler settings as configure_optimizers built them, before the restore
    # replaced them with the checkpoint's (engine.run.overrides).
    built: BuiltSettings
    # The world size the checkpoint was written with, when this run has another (else None).
    world_size_before: int | None = None


def capture(parts: RunParts, progress: ProgressTree, metrics_bytes: int, elapsed_seconds: float) -> RunSnapshot:
    """The state tree of the run as it is now (tensors are the live ones: encode before training goes on)."""
    return complete(parts, capture_volatile(parts, metrics_bytes, elapsed_seconds), progress)


def capture_volatile(parts: RunParts, metrics_bytes: int, elapsed_seconds: float) -> dict[str, Any]:
    """The entries of the state tree that change without an optimizer step (loop states,
    random streams, schedulers, callbacks, metrics length, time): with the model and
    optimizers as they are later, :func:`complete` makes the checkpoint of this instant
    (engine.run.exception_save). Tensors are the live ones."""
    callback_states = {key: callback.state_dict() for key, callback in parts.callbacks_by_key().items()}
    loops = parts.tree.loop_states()
    _check_loader_state([loops["data"]["loader_state"], loops["data"]["stream_state"]], parts.tree.data.name)
    return {
        SCHEDULERS: [schedule.scheduler.state_dict() for schedule in parts.setup.schedules],
        LOOPS: loops,
        RNG: capture_global_rng().to_state(),
        CALLBACKS: {key: value for key, value in callback_states.items() if value},
        METRICS_BYTES: metrics_bytes,
        ELAPSED_SECONDS: elapsed_seconds,
    }


def complete(parts: RunParts, volatile: dict[str, Any], progress: ProgressTree) -> RunSnapshot:
    """The snapshot made of ``volatile`` (:func:`capture_volatile`) and the model and
    optimizers as they are now."""
    state = {
        SIGNATURE: parts.signature(),
        MODULE: plain_state(parts.module.state_dict()),
        OPTIMIZERS: [optimizer.state_dict() for optimizer in parts.setup.optimizers],
        SCHEDULERS: volatile[SCHEDULERS],
        LOOPS: volatile[LOOPS],
        RNG: volatile[RNG],
        CALLBACKS: volatile[CALLBACKS],
        METRICS_BYTES: volatile[METRICS_BYTES],
        ELAPSED_SECONDS: volatile[ELAPSED_SECONDS],
        ENVELOPE: capture_envelope(parts.tree.device),
    }
    return RunSnapshot(state, encode_tree(progress), progress)


def _check_loader_state(loader_state: Any, data_name: str) -> None:
    """Refuse, naming the training data, a ``state_dict()`` the pickle-free codec cannot store
    (before the checkpoint write, where the error would name only a path in the tree)."""
    try:
        check_storable(loader_state, "state_dict()")
    except CheckpointWriteError as error:
        remedy = SHUFFLE_BUFFER_REMEDY if f".{SHUFFLE_BUFFER_KEY}." in str(error) else "make its state_dict() return those"
        raise DataError(f"the state_dict() of the training data {data_name} cannot go into a checkpoint: {error}; a checkpoint holds only tensors, numbers, "
                        f"strings, bytes, None and lists/tuples/dicts of them (no pickle): {remedy}") from error


def validate(name: str, state: Any) -> None:
    """Check the shape of a decoded state tree without touching any run; CheckpointCorrupt
    names what is wrong. Resume and ``inspect`` apply the same checks."""
    if not isinstance(state, dict) or set(state) != STATE_KEYS:
        keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise CheckpointCorrupt(f"{name}: the state tree has keys {keys}, expected {sorted(STATE_KEYS)}")
    _expect(name, SIGNATURE, state[SIGNATURE], dict)
    _expect(name, MODULE, state[MODULE], dict)
    for key, value in state[MODULE].items():
        if not isinstance(key, str) or not isinstance(value, (torch.Tensor, TensorShard)):
            raise CheckpointCorrupt(f"{name}: module entry {key!r} is not a named tensor")
    _expect(name, OPTIMIZERS, state[OPTIMIZERS], list)
    _expect(name, SCHEDULERS, state[SCHEDULERS], list)
    for key in (OPTIMIZERS, SCHEDULERS):
        if not all(isinstance(item, dict) for item in state[key]):
            raise CheckpointCorrupt(f"{name}: {key} holds an entry that is not a state dict")
    _expect(name, LOOPS, state[LOOPS], dict)
    if set(state[LOOPS]) != LOOP_KEYS:
        raise CheckpointCorrupt(f"{name}: loop states have keys {sorted(map(str, state[LOOPS]))}, expected {sorted(LOOP_KEYS)}")
    _expect(name, CALLBACKS, state[CALLBACKS], dict)
    metrics_bytes = state[METRICS_BYTES]
    if isinstance(metrics_bytes, bool) or not isinstance(metrics_bytes, int) or metrics_bytes < 0:
        raise CheckpointCorrupt(f"{name}: {METRICS_BYTES} must be a non-negative int, got {metrics_bytes!r}")
    elapsed = state[ELAPSED_SECONDS]
    if isinstance(elapsed, bool) or not isinstance(elapsed, (int, float)) or not math.isfinite(elapsed) or elapsed < 0:
        raise CheckpointCorrupt(f"{name}: {ELAPSED_SECONDS} must be a finite non-negative number, got {elapsed!r}")
    try:
        RngSnapshot.from_state(state[RNG]).check()
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as error:
        raise CheckpointCorrupt(f"{name}: the RNG state is malformed: {error}") from error
    try:
        _check_data_random_states(state[LOOPS]["data"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as error:
        raise CheckpointCorrupt(f"{name}: the data position's random state is malformed: {error}") from error
    check_saved_buffers(name, state[LOOPS]["data"])
    try:
        check_envelope_shape(state[ENVELOPE])
    except ValueError as error:
        raise CheckpointCorrupt(f"{name}: the {ENVELOPE} is malformed: {error}") from error


def _check_data_random_states(data: Any) -> None:
    """The random states the data position restores (engine.data.position: the loader's and
    samplers' generators now and at the epoch start, the global streams at the epoch start),
    each checked the way its generator would take it. ValueError names the bad one."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a map, got {type(data).__name__}")
    for key in ("generators_now", "epoch_start_generators"):
        for index, generator_state in enumerate(data[key]):
            check_generator_state(f"{key}[{index}]", generator_state)
    if data["epoch_start_rng"] is not None:
        RngSnapshot.from_state(data["epoch_start_rng"]).check()


def _expect(name: str, key: str, value: Any, kind: type) -> None:
    if not isinstance(value, kind):
        raise CheckpointCorrupt(f"{name}: {key} must be a {kind.__name__}, got {type(value).__name__}")


def check_compatible(name: str, state: Mapping[str, Any], parts: RunParts, world_size_changes: bool = False) -> None:
    """Refuse a checkpoint written by another setup or for another model, naming the difference.
    ``world_size_changes``: the run resumes it on another world size (already judged possible)."""
    saved, current = state[SIGNATURE], parts.signature()
    if world_size_changes:
        current.pop(WORLD_SIZE, None)
        saved = {key: value for key, value in saved.items() if key != WORLD_SIZE}
    else:
        check_world_size(name, saved, parts.world_size)
    differences = [f"{key}: checkpoint {saved.get(key)!r}, this run {value!r}"
                   for key, value in current.items()
                   if saved.get(key) != value and (key in saved or key not in NEWER_SIGNATURE_KEYS)]
    if differences:
        raise CheckpointIncompatible(f"{name} was written by a different run setup: " + "; ".join(differences) +
                                     _batch_size_remedy(saved, current, world_size_changes))
    check_module_state(name, parts.module, state[MODULE])


def _batch_size_remedy(saved: Mapping[str, Any], current: Mapping[str, Any], world_size_changes: bool) -> str:
    """What to do when a resume on another world size changed the DataLoader's batch size: the
    natural edit (per-rank batch = G / new world size) is the engine's job, not the script's."""
    if not world_size_changes or saved.get("batch_size") == current.get("batch_size"):
        return ""
    return (f"; keep the script's DataLoader batch_size={saved.get('batch_size')!r}: on another world size the "
            f"engine keeps the run's global batch (G={saved.get(global_order.GLOBAL_BATCH)!r}) and gives each rank "
            "G / world size itself")


def load_module_state(module: torch.nn.Module, saved_module: dict[str, torch.Tensor]) -> None:
    """Load a checkpoint's model state (plain keys) into ``module``, compiled or not."""
    keys = live_keys(module)
    module.load_state_dict({keys[key]: value for key, value in saved_module.items()}, strict=True)


def check_module_state(name: str, module: torch.nn.Module, saved_module: dict[str, torch.Tensor]) -> None:
    """Refuse model weights whose keys, shapes or dtypes differ from ``module``'s, naming them."""
    module_state = plain_state(module.state_dict())
    missing = sorted(set(module_state) - set(saved_module))
    unexpected = sorted(set(saved_module) - set(module_state))
    if missing or unexpected:
        raise CheckpointIncompatible(f"{name}: model keys differ: missing from checkpoint {missing}, not in model {unexpected}")
    for key, tensor in module_state.items():
        other = saved_module[key]
        if other.shape != tensor.shape or other.dtype != tensor.dtype:
            raise CheckpointIncompatible(f"{name}: model entry {key!r} is {tuple(other.shape)} {other.dtype} in the "
                                         f"checkpoint, {tuple(tensor.shape)} {tensor.dtype} in the model")


def restore(name: str, state: Any, progress: ProgressTree, parts: RunParts,
            rank_parts: Mapping[str, bytearray] | None = None) -> RestoredRun:
    """Put the run back to the checkpoint: validate, check compatibility, then load every part.
    ``rank_parts``: the checkpoint's other ranks' files (LoadedCheckpoint.extra_files), read to
    reshard a sharded checkpoint written by another world size. A failure raises (never a
    partial restore downgraded to a warning)."""
    validate(name, state)
    world_size_before = global_order.adapt_data(name, state, parts.tree.data, parts.module, parts.world_size, parts.rank,
                                                 parts.config.distributed_sampler)
    if is_sharded(state[SIGNATURE]):  # after the refusals of a world-size change, before any shard is placed
        state = live_shards(name, state, parts.module, parts.world_size, rank_parts or {})
    check_compatible(name, state, parts, world_size_changes=world_size_before is not None)
    built = built_settings(parts.setup)
    try:
        load_module_state(parts.module, state[MODULE])
        for optimizer, optimizer_state in zip(parts.setup.optimizers, state[OPTIMIZERS], strict=True):
            optimizer.load_state_dict(optimizer_state)
        for schedule, scheduler_state in zip(parts.setup.schedules, state[SCHEDULERS], strict=True):
            schedule.scheduler.load_state_dict(scheduler_state)
        parts.tree.load_progress(progress)
        parts.tree.load_loop_states(state[LOOPS])
        _restore_callbacks(name, state[CALLBACKS], parts)
        rng = RngSnapshot.from_state(state[RNG])
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, ProgressSchemaError) as error:
        raise CheckpointIncompatible(f"{name}: cannot restore this run from it: {type(error).__name__}: {error}") from error
    restore_global_rng(rng)
    if world_size_before is not None:
        global_order.reseed_after_change(state[RNG], parts.rank, parts.tree.step_counter.total)
    warn_on_envelope_change(name, state[ENVELOPE], capture_envelope(parts.tree.device))
    return RestoredRun(metrics_bytes=state[METRICS_BYTES], elapsed_seconds=float(state[ELAPSED_SECONDS]),
                       built=built, world_size_before=world_size_before)


def _restore_callbacks(name: str, saved: dict[str, Any], parts: RunParts) -> None:
    current = parts.callbacks_by_key()
    for key, callback in current.items():
        if key in saved:
            callback.load_state_dict(saved[key])
    dropped = [key for key, state in saved.items() if key not in current and state]
    if dropped:
        warn_user(f"{name} holds state for callbacks this run does not have: {dropped}; it is not used")
