"""What one checkpoint costs the training thread: its CPU time per snapshot, small model.

What is measured: ``time.thread_time`` (the calling thread's own CPU time: what it spends, not
what it waits for) around ``FitRun._save``, everything the training thread runs for one
checkpoint: collecting the state tree (``engine.run.state.capture``: the state_dicts, the RNG
states, the loop states, the progress bytes), encoding its description
(``engine.checkpoint.format.codec.encode_state``), the bulk copy of its tensors into the
snapshot buffer (``SnapshotBuffers.capture``), handing it to the writer, and the run's own
bookkeeping after it (the goodput ledger's row, ``Ledger.commit``; the display). Each of those
parts is timed the same way, per checkpoint, and the remainder of ``FitRun._save`` is printed as
``rest`` (the checkpoint policy's own work, the hand-over to the writer, the progress tree, the
metrics log's seal, the watchdog's marks).

The model is ``checkpoint_overhead.py``'s small one (a character-level LSTM language model:
embedding 32, LSTM hidden 128, 0.1M parameters, Adam; 34 tensors, a 1.2 MB state), trained
for one epoch with a checkpoint after every split, three ways interleaved in rounds (the first
way of a round rotates): ``thread`` (``writer="thread"``), ``process`` (``writer="process"``,
``when_behind="skip"``) and ``fast`` (``writer="thread"`` into a fast tier under /dev/shm,
``local_tier``, durable copies every 60 s and at the end). One intra-op thread, as the other
checkpoint benchmarks. An untimed warm-up run of each way comes first. Reported per way: the
median per checkpoint over every checkpoint of every round; the last line is the writer
thread's median ``FitRun._save`` (the issue's figure, goal <= 0.25 ms). The ways must end each
round with identical parameters (``torch.equal``): checkpoints must not change training.

Reproduce (from the repository root, in the environment of the README)::

    python benchmarks/snapshot_cost.py            # 3 rounds of 20 batches (480 checkpoints a way), about 1 min
    python benchmarks/snapshot_cost.py --quick    # 1 round of 5 batches

Before/after a change: run it with ``PYTHONPATH=DIR`` where DIR holds the codebase before
(``git archive <commit> | tar -x -C DIR``), alternating with runs of the current one.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_overhead  # noqa: E402  (the small model and its data)

import engine  # noqa: E402
import engine.checkpoint.policy  # noqa: E402
import engine.run.state  # noqa: E402
from engine.checkpoint.writers.buffers import SnapshotBuffers  # noqa: E402
from engine.goodput.ledger import Ledger  # noqa: E402
from engine.run.run import FitRun  # noqa: E402

WAYS = ("thread", "process", "fast")
PARTS = ("capture", "encode", "copy", "ledger")
FAST_TIER_ROOT = "/dev/shm"


class ThreadClock(checkpoint_overhead.CheckpointTimers):
    """checkpoint_overhead's timers around the functions one checkpoint runs on the training
    thread; their ``<label> cpu`` entries are the training thread's own CPU seconds."""

    TARGETS = (
        (FitRun, "_save", "save"),
        (engine.run.state, "capture", "capture"),
        (engine.checkpoint.policy, "encode_state", "encode"),
        (SnapshotBuffers, "capture", "copy"),
        (Ledger, "commit", "ledger"),
    )


def checkpoint_config(way: str, local_tier: str | None) -> engine.CheckpointConfig:
    if way == "process":
        return engine.CheckpointConfig(every_n_splits=1, keep_last=2, writer="process", when_behind="skip")
    return engine.CheckpointConfig(every_n_splits=1, keep_last=2, writer="thread", local_tier=local_tier,
                                   durable_every_seconds=60.0 if local_tier else None)


def one_run(workload: checkpoint_overhead.Workload, way: str, batches: list[Any], work: str,
            clock: ThreadClock) -> tuple[dict[str, list[float]], torch.nn.Module]:
    """One fresh run of ``way``; the thread CPU seconds of each checkpoint's parts, and the
    trained model."""
    model = checkpoint_overhead.fresh_model(workload)
    run_dir = tempfile.mkdtemp(prefix=f"{way}-", dir=work)
    local_tier = tempfile.mkdtemp(prefix="splitloop-snapshot-cost-", dir=FAST_TIER_ROOT) if way == "fast" else None
    config = engine.TrainerConfig(max_epochs=1, run_dir=run_dir, checkpoint=checkpoint_config(way, local_tier),
                                  progress_bar="off")
    clock.take()
    try:
        engine.Trainer(config).fit(model, batches, resume="off")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if local_tier is not None:
            shutil.rmtree(local_tier, ignore_errors=True)
    return clock.take(), model


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 3, 1 with --quick or --smoke)")
    parser.add_argument("--batches", type=int, default=None, help="batches per run (8 splits each; default 20, 5 with --quick)")
    parser.add_argument("--quick", action="store_true", help="one round of shorter runs")
    parser.add_argument("--smoke", action="store_true", help="every way once, tiny runs (CI runs it; the figures mean nothing)")
    parser.add_argument("--dir", default=None, help="where to create the temporary directory (default: the current directory)")
    arguments = parser.parse_args()
    short = arguments.quick or arguments.smoke
    arguments.repeats = arguments.repeats or (1 if short else 3)
    arguments.batches = arguments.batches or (1 if arguments.smoke else 5 if arguments.quick else 20)
    if arguments.repeats < 1 or arguments.batches < 1:
        parser.error("--repeats and --batches must be positive")
    return arguments


def main() -> None:
    arguments = parse_arguments()
    torch.set_num_threads(checkpoint_overhead.THREADS)
    workload = dataclasses.replace(checkpoint_overhead.SMALL, batches=arguments.batches)
    if arguments.smoke:
        workload = dataclasses.replace(workload, sequence_length=64)
    batches = checkpoint_overhead.make_batches(workload)
    work = checkpoint_overhead.scratch_directory("snapshot_cost-", arguments.dir)
    clock = ThreadClock()
    clock.install()
    recorded: dict[str, dict[str, list[float]]] = {way: collections.defaultdict(list) for way in WAYS}
    try:
        for way in () if arguments.smoke else WAYS:  # warm-up: first-call costs, the writer process's start
            one_run(dataclasses.replace(workload, batches=1), way, batches[:1], work, clock)
        for index in range(arguments.repeats):
            order = WAYS[index % len(WAYS):] + WAYS[:index % len(WAYS)]
            models = []
            for way in order:
                seconds, model = one_run(workload, way, batches, work, clock)
                models.append(model)
                for label, values in seconds.items():
                    recorded[way][label] += values
            if not checkpoint_overhead.same_parameters(models):
                raise RuntimeError(f"round {index + 1}: the ways trained different parameters")
    finally:
        clock.uninstall()
        shutil.rmtree(work, ignore_errors=True)

    def ms(way: str, label: str) -> float:
        values = recorded[way].get(f"{label} cpu", [])
        return statistics.median(values) * 1e3 if values else 0.0

    for way in WAYS:
        parts = {label: ms(way, label) for label in PARTS}
        rest = ms(way, "save") - sum(parts.values())
        print(f"{way}: training thread CPU per checkpoint (FitRun._save) {ms(way, 'save'):.3f} ms: "
              + ", ".join(f"{label} {value:.3f}" for label, value in parts.items())
              + f", rest {rest:.3f} (medians of {len(recorded[way].get('save cpu', []))} checkpoints)")
    print(f"training thread CPU per snapshot: {ms('thread', 'save'):.3f} ms (small model, writer thread, "
          f"every split, median FitRun._save; goal <= 0.25 ms)")


if __name__ == "__main__":
    main()
