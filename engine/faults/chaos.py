"""``python -m engine chaos``: the demo under a matrix of faults, each resumed and compared."""

from __future__ import annotations

import random

from engine.faults import Fault
from engine.faults.points import CHECKPOINT_POINTS, IO_POINTS, LOOP_POINTS

# Highest arrival count to draw from, per point, for a demo run of 2 epochs
# (48 splits, 48 optimizer steps, 12 batches, ~50 checkpoints of 3 data files each).
_HIT_RANGE = {
    "step_start": 40, "after_backward": 40, "after_optimizer_step": 40, "split_end": 40,
    "split_end_after_checkpoint": 40, "batch_end": 10, "epoch_end": 2,
    "checkpoint_before_file": 120, "checkpoint_after_file": 120, "checkpoint_before_manifest": 40,
    "checkpoint_before_rename": 40, "checkpoint_after_rename": 40, "checkpoint_retention": 38,
    "filesystem_write": 200,
}


# Where a hang is tried: every loop point (the watchdog's monitor thread sees the main thread
# stuck there), a checkpoint write and a storage write that never return. A ``sigstop`` is not
# tried: a process that trains alone stops with its monitor; a torchrun job's other ranks see it
# (tests/watchdog/test_hang_torchrun.py).
_HANG_POINTS = (*LOOP_POINTS, "checkpoint_before_manifest", "filesystem_write")


def fault_matrix() -> list[tuple[str, str]]:
    """The (point, kind) pairs that make sense for the demo."""
    pairs = [(point, kind) for point in LOOP_POINTS for kind in ("sigkill", "raise", "sigterm")]
    pairs += [(point, kind) for point in CHECKPOINT_POINTS for kind in ("sigkill", "raise", "enospc")]
    pairs += [(point, kind) for point in IO_POINTS for kind in ("enospc", "eio")]
    pairs += [(point, "hang") for point in _HANG_POINTS]
    return pairs


def chaos_faults(trials: int | None, seed: int) -> list[Fault]:
    """``trials`` faults (all pairs when None), in a shuffled order with random arrival counts."""
    rng = random.Random(seed)
    pairs = fault_matrix()
    rng.shuffle(pairs)
    if trials is not None:
        pairs = [pairs[i % len(pairs)] for i in range(trials)]
    return [Fault(point, rng.randint(1, _HIT_RANGE[point]), kind) for point, kind in pairs]
