"""What durable commits on the other core cost training, without any engine code in the committer.

A writer process (``CheckpointConfig(writer="process")``) takes a checkpoint's Python off the
training process, but not the commit's file system work: with a checkpoint every split it commits
one after another, on the second core, and its fsyncs make the kernel work (journal commits,
writeback, interrupts) on every core. This script measures that floor on this machine: the
small model of ``checkpoint_overhead.py`` (engine ``Trainer``, one intra-op thread, a plain
``copy_`` of its state after every split: that script's ``floor`` way) runs while another process
does one of:

* ``idle``: no other process;
* ``spin``: a Python busy loop (CPU work with no system calls: what pure computation on the other
  core costs training, through shared caches and memory);
* ``commit``: the file system work of a checkpoint commit, in a loop as fast as the disk allows,
  with no encoding and no engine: into a fresh directory, a file of the small model's tensor
  bytes and three small files, each fsynced, the directory fsynced, a line appended to a log
  and fsynced, the directory renamed into place, its parent fsynced, the checkpoint before the
  previous one deleted (what the writer process does per checkpoint, minus its Python).

Runs are interleaved in rounds (the first kind rotating); reported: the median of the per-round
ratios of the steady-state time per split (first to last split end) to ``idle``, and how many
commits the loop made per split. The ``commit`` ratio is the least that committing every split's
checkpoint durably can cost the small model here, whatever the writer's language: compare it with
``checkpoint_overhead.py``'s ``process/none`` per-split figure (which also holds the training
thread's own snapshot work and the writer's Python).

Reproduce (from the repository root, in the environment of the README)::

    python benchmarks/commit_contention.py              # 5 rounds, about 30 s on 2 cores
    python benchmarks/commit_contention.py --quick      # 1 round, shorter runs
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile

import torch

import checkpoint_overhead as overhead

KINDS = ("idle", "spin", "commit")


# ---- the training side ---------------------------------------------------------------------------
class Neighbour:
    """The other process of one run: started before training, stopped after it."""

    def __init__(self, kind: str, root: str, tensor_bytes: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "commit_neighbour.py"),
             kind, root, str(tensor_bytes)],
            stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {kind} process did not start")

    def stop(self) -> int:
        """Stop the process; what it counted (commits or loop iterations)."""
        self.process.send_signal(signal.SIGTERM)
        output, _ = self.process.communicate(timeout=60)
        if self.process.returncode != 0:
            raise RuntimeError(f"the other process exited with {self.process.returncode}")
        return int(output.strip())


def tensor_bytes(workload: overhead.Workload) -> int:
    """The bytes of the model's and Adam's tensors (parameters, two moments each)."""
    return sum(3 * p.numel() * p.element_size() for p in overhead.fresh_model(workload).parameters())


def timed_run(workload: overhead.Workload, kind: str, batches: list[overhead.Batch], work: str,
              timers: overhead.CheckpointTimers, max_steps: int | None) -> tuple[float, int, int]:
    """Seconds per split of one training run beside ``kind``; its splits and the other's count."""
    root = tempfile.mkdtemp(prefix=f"contention-{kind}-", dir=work)
    neighbour = None if kind == "idle" else Neighbour(kind, root, tensor_bytes(workload))
    try:
        os.sync()
        result = overhead.timed_run(workload, "floor", batches, work, timers, max_steps)
    finally:
        count = neighbour.stop() if neighbour is not None else 0
        shutil.rmtree(root)
    splits = (max_steps or workload.batches) * workload.sequence_length // workload.split_length
    return result.per_split_seconds, splits, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 5, 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="one round of shorter runs")
    parser.add_argument("--smoke", action="store_true", help="one round of one batch (CI runs it; the figures mean nothing)")
    parser.add_argument("--dir", default=None, help="where to create the temporary directory (default: the current directory)")
    arguments = parser.parse_args()
    repeats = arguments.repeats if arguments.repeats is not None else (1 if arguments.quick or arguments.smoke else 5)
    if repeats < 1:
        parser.error("--repeats must be positive")
    torch.set_num_threads(overhead.THREADS)
    workload = dataclasses.replace(overhead.SMALL, batches=1 if arguments.smoke else 3 if arguments.quick else 20)
    work = overhead.scratch_directory("commit_contention-", arguments.dir)
    timers = overhead.CheckpointTimers()
    batches = overhead.make_batches(workload)
    rounds: list[dict[str, tuple[float, int, int]]] = []
    try:
        for index, results in overhead.interleaved_rounds(
                list(KINDS), repeats, lambda kind, max_steps: timed_run(workload, kind, batches, work, timers, max_steps)):
            print(f"  round {index + 1}: " + ", ".join(
                f"{kind} {results[kind][0] * 1e3:.2f} ms/split" for kind in KINDS)
                + f"; commits per split {results['commit'][2] / results['commit'][1]:.2f}")
            rounds.append(results)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = {kind: statistics.median(r[kind][0] / r["idle"][0] for r in rounds) for kind in KINDS}
    per_split = statistics.median(r["commit"][2] / r["commit"][1] for r in rounds)
    print(f"small model, split {statistics.median(r['idle'][0] for r in rounds) * 1e3:.2f} ms beside an idle core "
          f"(copy floor included), {tensor_bytes(workload) / 1e6:.2f} MB of tensors per commit")
    print(f"spin/idle per split: {ratio['spin']:.3f} (a busy loop on the other core)")
    print(f"durable-commit contention floor: {ratio['commit']:.3f} (commit loop / idle per split, "
          f"{per_split:.2f} commits per split; medians of {len(rounds)} per-round ratios)")


if __name__ == "__main__":
    main()
