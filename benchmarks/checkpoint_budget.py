"""The overhead budget: ``CheckpointConfig(every_n_splits="auto", max_overhead=0.05)`` against
no checkpoints, on the two models of ``benchmarks/checkpoint_overhead.py``.

What is measured: the wall time of one training run (``engine.Trainer.fit``, Adam, TBPTT, one
epoch, ``resume="off"``, model built outside the timing), four ways:

* ``none``: ``TrainerConfig(run_dir=None, checkpoint=None)``;
* ``last-only``: ``CheckpointConfig(every_n_splits=None, keep_last=2, writer="thread")``: a
  run dir and the one checkpoint every run ends with (which ``fit`` waits for), no cadence:
  what any run with checkpoints pays once, which no interval can reduce;
* ``auto-sync``: ``CheckpointConfig(every_n_splits="auto", max_overhead=0.05, keep_last=2)``,
  checkpoints written on the training thread;
* ``auto-async``: the same with ``writer="thread"`` (``max_in_flight=1``,
  ``when_behind="wait"``): the budget counts the time a checkpoint blocks training plus the
  slowdown of the splits its background write overlaps.
* ``auto-process``: the same with ``writer="process"``: the budget counts the training
  process's time only (what a checkpoint blocks, and the slowdown of the splits while the
  writer process holds a snapshot); the writer process's own CPU time (user and system,
  ``RUSAGE_CHILDREN``, its start included) is printed beside it.

The models, the data, the thread count and the round structure are those of
``checkpoint_overhead.py`` (imported from it): the ways run interleaved in rounds, the first way
rotating, after an untimed warm-up of each way (one split); each checkpointing run gets a fresh
run directory under the current directory (or ``--dir``) on a real filesystem, deleted
(untimed) after the run, with ``os.sync()`` (untimed) before every run. The script checks with
``torch.equal`` that the ways end with identical parameters in every round. Five rounds (three
there): "auto" checkpoints far less often than every split, so its cost is a few percent, which
load from other processes on a shared 2-core machine easily swamps in one round.

Runs are longer than there, so that "auto" can settle: the budget measures before it decides
(the first split is not measured; the interval grows 1, 2, ... until a baseline split time and
a checkpoint's cost are known, usually at the second checkpoint, after split 3; the cost is a
median, the baseline a minimum, over the last five checkpoints: see engine/checkpoint/budget.py):

* ``small``: 32 batches, 256 splits of ~9 ms (``--quick``: 8 batches, 64 splits);
* ``25M``: 5 batches, 20 splits of ~0.7 s (``--quick``: 2 batches, 8 splits). Only 16-24 splits
  fit the time of a benchmark, so the 25M figure is that of a *short* run: it includes the
  start of "auto" (checkpoints after splits 1 and 3, while it measures) and the run's final
  checkpoint (a run always ends with one; 300 MB written and fsynced, 1-2 s on this machine's
  disk, against ~14 s of training), both of which a long run amortizes. The steady-state line
  (first to last split end, which leaves out the final checkpoint and its flush) is closer to
  the cadence's own cost, but still includes the start. Measured here at 02:40 UTC (a quiet
  machine): each asynchronous checkpoint of the 25M model blocked ~60 ms (the copy) and slowed
  the one split its write overlapped by ~70-100 ms, so "auto" settled at 5-7 splits; the run
  wrote 5 checkpoints (after splits 1, 3, ~9, ~15 and the final one) for 1.1-1.4 s of extra
  wall time, most of it the start and the final flush.

Reported per model: the median wall time of each way, the medians of the per-round ratios
auto-sync / none and auto-async / none (and last-only / none, and the auto ways / last-only: the
cost of the cadence alone, which is what ``max_overhead`` bounds), the steady-state per-split ratios, the interval reached
(``FitResult.checkpoint_interval``, median over rounds), the checkpoints written per run, and the
intervals "auto" chose in the last round's asynchronous run.

Reproduce (from the repository root, in the environment of the README)::

    python benchmarks/checkpoint_budget.py            # 5 rounds per model, ~7 min on 2 cores
    python benchmarks/checkpoint_budget.py --quick    # 1 round, shorter runs, under a minute

The last two lines are ``small auto overhead ratio: X.XXX (async, max_overhead=0.05, interval N
splits)`` and ``25M auto overhead ratio: X.XXX (async, max_overhead=0.05, interval N splits)``:
the wall-time ratio auto-async / none and the interval reached.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

import engine
from checkpoint_overhead import (LARGE, SMALL, THREADS, Batch, LanguageModel, SplitClock, Workload,
                                 finish_round, fresh_model, interleaved_rounds, make_batches,
                                 parse_arguments, same_parameters, scratch_directory, smoke_workloads)
from checkpoint_overhead import children_cpu_seconds
from engine.checkpoint.budget import OverheadBudget
from engine.checkpoint.policy import RunCheckpointer

WAYS = ("none", "last-only", "auto-sync", "auto-async", "auto-process")
AUTO_WAYS = ("auto-sync", "auto-async", "auto-process")
MAX_OVERHEAD = 0.05


class CheckpointLog:
    """Counts the checkpoints written and the intervals "auto" chose, by wrapping
    ``RunCheckpointer.save`` and ``OverheadBudget.record`` (in this script only)."""

    def __init__(self) -> None:
        self.written = 0
        self.intervals: list[int] = []
        self._originals: list[tuple[type, str, Callable[..., Any]]] = []

    def install(self) -> None:
        save, record = RunCheckpointer.save, OverheadBudget.record

        def counted_save(checkpointer: RunCheckpointer, *args: Any, **kwargs: Any) -> bool:
            written = save(checkpointer, *args, **kwargs)
            self.written += bool(written)
            return written

        def logged_record(budget: OverheadBudget, *args: Any, **kwargs: Any) -> int:
            interval = record(budget, *args, **kwargs)
            self.intervals.append(interval)
            return interval

        self._originals = [(RunCheckpointer, "save", save), (OverheadBudget, "record", record)]
        setattr(RunCheckpointer, "save", counted_save)
        setattr(OverheadBudget, "record", logged_record)

    def uninstall(self) -> None:
        for owner, name, original in self._originals:
            setattr(owner, name, original)

    def take(self) -> tuple[int, list[int]]:
        taken = self.written, self.intervals
        self.written, self.intervals = 0, []
        return taken


@dataclasses.dataclass
class RunResult:
    seconds: float
    per_split_seconds: float
    interval: int | None
    checkpoints: int
    intervals: list[int]
    model: LanguageModel | None
    # CPU seconds (user and system) of the child processes the run waited for: its writer process.
    writer_cpu_seconds: float = 0.0


def checkpoint_policy(way: str) -> engine.CheckpointConfig | None:
    if way == "none":
        return None
    if way == "last-only":
        return engine.CheckpointConfig(every_n_splits=None, keep_last=2, writer="thread")
    return engine.CheckpointConfig(every_n_splits="auto", max_overhead=MAX_OVERHEAD, keep_last=2,
                                   writer={"auto-async": "thread", "auto-process": "process"}.get(way, "sync"))


def timed_run(workload: Workload, way: str, batches: list[Batch], work: str, log: CheckpointLog,
              max_steps: int | None = None) -> RunResult:
    """One fresh run of ``way`` in a fresh run directory (model built outside the timing)."""
    model = fresh_model(workload)
    run_dir = None if way == "none" else tempfile.mkdtemp(prefix=f"{workload.label}-{way}-", dir=work)
    config = engine.TrainerConfig(max_epochs=1, max_steps=max_steps, run_dir=run_dir,
                                  checkpoint=checkpoint_policy(way), progress_bar="off")
    clock = SplitClock()
    os.sync()
    log.take()
    started, children_started = time.perf_counter(), children_cpu_seconds()
    result = engine.Trainer(config, callbacks=[clock]).fit(model, batches, resume="off")
    seconds = time.perf_counter() - started
    writer_cpu_seconds = children_cpu_seconds() - children_started
    checkpoints, intervals = log.take()
    if run_dir is not None:
        shutil.rmtree(run_dir)
    return RunResult(seconds, clock.per_split_seconds(), result.checkpoint_interval, checkpoints, intervals, model,
                     writer_cpu_seconds)


def run_rounds(workload: Workload, repeats: int, work: str, log: CheckpointLog) -> list[dict[str, RunResult]]:
    """``repeats`` interleaved rounds of the ways."""
    batches = make_batches(workload)
    rounds = []
    for index, results in interleaved_rounds(
            WAYS, repeats, lambda way, max_steps: timed_run(workload, way, batches, work, log, max_steps)):
        equal = same_parameters([model for model in (results[way].model for way in WAYS) if model is not None])
        print(f"  round {index + 1}: none {results['none'].seconds:.2f} s, "
              f"last-only {results['last-only'].seconds:.2f} s, "
              + ", ".join(f"{way} {results[way].seconds:.2f} s (interval {results[way].interval}, "
                          f"{results[way].checkpoints} checkpoints)" for way in AUTO_WAYS)
              + f"; parameters equal: {equal}")
        finish_round(workload, results, equal)
        rounds.append(results)
    return rounds


def median_ratio(rounds: list[dict[str, RunResult]], way: str, field: str = "seconds", to: str = "none") -> float:
    """Median of the per-round ratios ``way`` / ``to``."""
    return statistics.median(getattr(r[way], field) / getattr(r[to], field) for r in rounds)


def median_interval(rounds: list[dict[str, RunResult]], way: str) -> int:
    return statistics.median_low(r[way].interval or 0 for r in rounds)


def report(workload: Workload, rounds: list[dict[str, RunResult]]) -> tuple[float, int]:
    """Print the figures of one model; returns the auto-async wall-time ratio and interval."""
    label = workload.label
    wall = {way: statistics.median(r[way].seconds for r in rounds) for way in WAYS}
    split = {way: statistics.median(r[way].per_split_seconds for r in rounds) for way in WAYS}
    print(f"{label}: median wall time " + ", ".join(f"{way} {wall[way]:.3f} s" for way in WAYS))
    print(f"{label}: ratio auto-sync/none {median_ratio(rounds, 'auto-sync'):.3f}, auto-async/none "
          f"{median_ratio(rounds, 'auto-async'):.3f} (medians of {len(rounds)} per-round ratios; goal <= "
          f"{1 + MAX_OVERHEAD:.2f}); of which a run dir and its last checkpoint: last-only/none "
          f"{median_ratio(rounds, 'last-only'):.3f}; the cadence alone: auto-sync/last-only "
          f"{median_ratio(rounds, 'auto-sync', to='last-only'):.3f}, auto-async/last-only "
          f"{median_ratio(rounds, 'auto-async', to='last-only'):.3f}")
    print(f"{label}: steady state per split " + ", ".join(f"{way} {split[way] * 1e3:.1f} ms" for way in WAYS)
          + f"; ratio auto-sync/none {median_ratio(rounds, 'auto-sync', 'per_split_seconds'):.3f}, auto-async/none "
          f"{median_ratio(rounds, 'auto-async', 'per_split_seconds'):.3f} (end of run left out)")
    checkpoints = {way: statistics.median_low(r[way].checkpoints for r in rounds) for way in AUTO_WAYS}
    print(f"{label}: interval reached auto-sync {median_interval(rounds, 'auto-sync')} splits "
          f"({checkpoints['auto-sync']} checkpoints per run), auto-async {median_interval(rounds, 'auto-async')} "
          f"splits ({checkpoints['auto-async']} checkpoints per run); intervals chosen in the last auto-async run: "
          + " ".join(str(interval) for interval in rounds[-1]["auto-async"].intervals))
    writer_cpu = statistics.median(r["auto-process"].writer_cpu_seconds for r in rounds)
    print(f"{label}: auto-process/none {median_ratio(rounds, 'auto-process'):.3f} (interval "
          f"{median_interval(rounds, 'auto-process')} splits; wall time, as above); its writer "
          f"process's CPU {writer_cpu * 1e3:.0f} ms per run, "
          f"{writer_cpu * 1e3 / max(1, checkpoints['auto-process']):.1f} ms per checkpoint (its start included)")
    return median_ratio(rounds, "auto-async"), median_interval(rounds, "auto-async")


def workloads(arguments: argparse.Namespace) -> list[Workload]:
    if arguments.smoke:
        return smoke_workloads()
    if arguments.quick:
        return [dataclasses.replace(SMALL, batches=8), dataclasses.replace(LARGE, batches=2)]
    return [dataclasses.replace(SMALL, batches=32), dataclasses.replace(LARGE, batches=5)]


def main() -> None:
    arguments = parse_arguments(__doc__, default_repeats=5)
    torch.set_num_threads(THREADS)
    work = scratch_directory("checkpoint_budget-", arguments.dir, f", max_overhead {MAX_OVERHEAD}")
    log = CheckpointLog()
    log.install()
    figures: dict[str, tuple[float, int]] = {}
    try:
        for workload in workloads(arguments):
            splits = workload.batches * workload.sequence_length // workload.split_length
            print(f"{workload.label}: LSTM {workload.layers}x{workload.hidden}, {workload.batches} batches of "
                  f"{workload.batch_size}x{workload.sequence_length}, {splits} splits of {workload.split_length} per run")
            figures[workload.label] = report(workload, run_rounds(workload, arguments.repeats, work, log))
    finally:
        log.uninstall()
        shutil.rmtree(work, ignore_errors=True)
    for label in ("small", "25M"):
        ratio, interval = figures[label]
        print(f"{label} auto overhead ratio: {ratio:.3f} (async, max_overhead={MAX_OVERHEAD}, interval {interval} splits)")


if __name__ == "__main__":
    main()
