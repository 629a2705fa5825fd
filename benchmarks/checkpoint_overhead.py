"""Checkpoint overhead on training: no checkpoints, synchronous and asynchronous checkpoints.

What is measured: the wall time of one training run (``engine.Trainer.fit``, Adam, TBPTT, one
epoch, ``resume="off"``, built model excluded from the timing) run five ways (``fast`` and
``floor`` are described at the end of this docstring):

* ``none``: ``TrainerConfig(run_dir=None, checkpoint=None)``;
* ``sync``: a checkpoint after every split, ``CheckpointConfig(every_n_splits=1, keep_last=2)``,
  written on the training thread;
* ``async``: the same with ``writer="thread"`` (``max_in_flight=1``, ``when_behind="wait"``):
  the training thread encodes the state and copies its tensors into reused buffers, a
  background thread writes, fsyncs and commits.

Each checkpointing run gets a fresh run directory, created under the current directory (or
``--dir``) on a real filesystem, never /dev/shm, and deleted (untimed) after the run;
``os.sync()`` runs (untimed) before every run so that no run pays for another's dirty pages.
With ``at_epoch_end`` left at its default, a run of N splits writes N + 1 checkpoints (the
epoch-end checkpoint follows the last split's).

Two models, both character-level LSTM language models (embedding -> LSTM -> linear):

* ``small``: embedding 32, LSTM hidden 128, vocabulary 64 (about 0.1M parameters, a 1.2 MB
  checkpoint), batches of 16 x 256 cut into 8 TBPTT splits of 32 steps; 10 ms-scale splits, so
  the fixed per-checkpoint costs (6 fsyncs, a rename, retention) dominate.
* ``25M``: vocabulary 4096, embedding 1024, 2-layer LSTM hidden 1024 (25.2M parameters, a
  300 MB checkpoint with Adam's two moments), batches of 8 x 64 cut into 4 splits of 16 steps.

The ways run interleaved in rounds (the first way of a round rotates: A B C, B C A, C A B,
...); after an untimed warm-up of each way (one split). Reported per model: the median wall
time of each way, and the medians of the per-round ratios sync / none and async / none (each
round runs under the same machine conditions, so a per-round ratio cancels slow drift that a
ratio of two medians would not). Also reported: the steady-state time per split (first to last
split end, which leaves out the end of the run: the epoch-end checkpoint and the final flush),
and where each checkpoint's time goes, from timers wrapped (in this script only) around
``FitRun._save`` (everything the training thread spends on one checkpoint), ``encode_state``,
``BackgroundWriter.submit`` (waiting for a free buffer set, then the copy),
``SnapshotBuffers.capture`` (the copy) and ``_WriterBase.commit_one`` (the write, in the background
thread when asynchronous), and the process CPU time per checkpoint (every thread: the run's CPU
time minus that of the run without checkpoints in the same round, over the checkpoints of a
run), a figure that other processes on a shared machine disturb less than wall time; and the
training thread's own CPU time per checkpoint (``time.thread_time`` around ``FitRun._save`` and
around the copy), which leaves out what that thread waits for (the GIL, a free buffer). The script checks with ``torch.equal`` that the ways end with
identical parameters in every round: checkpoints must not change training.

Blocking against a plain copy: for each model, after its runs, ``encode_state`` of the state
tree plus ``SnapshotBuffers.capture`` of its tensors into buffers allocated by a warm-up capture
(the reuse the engine does from one checkpoint to the next) is timed against
``[t.clone() for t in tensors]`` of the same tensors (model ``state_dict`` and optimizer state;
two untimed clones first, so that the allocator too is in its steady state), interleaved,
median of per-pair ratios; the goal is <= 1.2. A ``copy_`` into preallocated
buffers is printed too, as the floor. The same clone time also divides the real runs'
median blocking time per asynchronous checkpoint.

Reproduce (from the repository root, in the environment of the README)::

    python benchmarks/checkpoint_overhead.py            # 3 rounds per model, 3-4 min on 2 cores
    python benchmarks/checkpoint_overhead.py --quick    # 1 round, shorter runs, 30-50 s

The last two lines are ``small async every-split overhead ratio: X.XXX (async every split / no
checkpoints, small model)`` and ``fast-tier every-split overhead ratio: X.XXX (floor Y.YYY; 25M
model)``: ``fast`` is asynchronous checkpoints after every split into a fast tier under /dev/shm
(``local_tier``; durable copies every 60 s and at the end of the run, so one in these short
runs), ``floor`` is training plus one plain ``copy_`` of the model's and optimizer's tensors
into preallocated buffers after every split (no run dir), both measured in the same rounds.
The fast-tier figures are per split in the steady state (first to last split end): what
checkpointing *every split* costs. The line before them gives the same two as wall-time ratios,
which also hold the one-time end of a checkpointed run (its last checkpoint made durable: about
300 MB written and fsynced, which ``fit`` waits for, against none for the floor), a fixed cost
that a run of 8 splits does not amortize.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import resource
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable, Iterator

import torch

import engine
import engine.checkpoint.policy
from engine.checkpoint.format.codec import encode_state
from engine.checkpoint.writers.buffers import SnapshotBuffers
from engine.checkpoint.writers.writer import BackgroundWriter, _WriterBase
from engine.run.run import FitRun
from engine.data.rng import capture_global_rng

# One intra-op thread: on a 2-core machine shared with other work, 2 threads oversubscribe; it
# also leaves the second core to the background writer, as a GPU job leaves CPU cores free.
THREADS = 1
SEED = 1234
WAYS = ("none", "sync", "async", "process", "fast", "floor")
FAST_TIER_ROOT = "/dev/shm"

Batch = tuple[torch.Tensor, torch.Tensor]
Hidden = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model and the data of one run."""

    label: str
    vocabulary: int
    embedding: int
    hidden: int
    layers: int
    batch_size: int
    sequence_length: int
    split_length: int
    batches: int


SMALL = Workload("small", vocabulary=64, embedding=32, hidden=128, layers=1,
                 batch_size=16, sequence_length=256, split_length=32, batches=10)
# The 25M model: a step (forward, backward, Adam) of 8 sequences x 16 time steps takes about
# 0.8-1.5 s on one core, against 50-100 ms to copy its 300 MB of state into reused buffers:
# 10-20x, so that a snapshot is a small part of a step, as on an accelerator where the state
# copy is a fraction of a step. Writing and fsyncing those 300 MB takes 1.0-1.9 s on this
# machine's disk, about one step: whether the background writer keeps up with a checkpoint
# every split is then part of what the async figure shows (with ``when_behind="wait"`` the
# training thread waits for it). Longer steps would not fit the time budget of the script.
LARGE = Workload("25M", vocabulary=4096, embedding=1024, hidden=1024, layers=2,
                 batch_size=8, sequence_length=64, split_length=16, batches=2)


class LanguageModel(engine.Module):
    """Embedding -> LSTM -> linear, trained with TBPTT and Adam."""

    def __init__(self, workload: Workload) -> None:
        super().__init__()
        self.tbptt_split_length = workload.split_length
        self.embed = torch.nn.Embedding(workload.vocabulary, workload.embedding)
        self.rnn = torch.nn.LSTM(workload.embedding, workload.hidden, num_layers=workload.layers, batch_first=True)
        self.head = torch.nn.Linear(workload.hidden, workload.vocabulary)

    def training_step(self, batch: Batch, hidden: Hidden | None) -> tuple[torch.Tensor, Hidden]:
        inputs, targets = batch
        output, hidden = self.rnn(self.embed(inputs), hidden)
        loss = torch.nn.functional.cross_entropy(self.head(output).flatten(0, 1), targets.flatten())
        return loss, hidden

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def make_batches(workload: Workload) -> list[Batch]:
    """The run's batches of (inputs, next-character targets), the same on every call."""
    generator = torch.Generator().manual_seed(SEED)
    batches = []
    for _ in range(workload.batches):
        shape = (workload.batch_size, workload.sequence_length + 1)
        codes = torch.randint(workload.vocabulary, shape, generator=generator)
        batches.append((codes[:, :-1].contiguous(), codes[:, 1:].contiguous()))
    return batches


def fresh_model(workload: Workload) -> LanguageModel:
    torch.manual_seed(SEED)
    return LanguageModel(workload)


# ---- timers around the engine's checkpoint path (this script only) ----------------------------
class CheckpointTimers:
    """Wraps the engine functions a checkpoint goes through and records each call's seconds,
    by label. ``_WriterBase.commit_one`` runs in the writer thread when asynchronous; appending to a
    list is atomic under the GIL."""

    TARGETS = (
        (FitRun, "_save", "save"),
        (engine.checkpoint.policy, "encode_state", "encode"),
        (BackgroundWriter, "submit", "submit"),
        (SnapshotBuffers, "capture", "capture"),
        (_WriterBase, "commit_one", "commit"),
    )

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = collections.defaultdict(list)
        self._originals: list[tuple[object, str, Callable[..., Any]]] = []

    def install(self) -> None:
        for owner, name, label in self.TARGETS:
            original = getattr(owner, name)
            self._originals.append((owner, name, original))
            setattr(owner, name, self._timed(original, label))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    def take(self) -> dict[str, list[float]]:
        """The seconds recorded since the last call, and a fresh start."""
        taken, self.seconds = dict(self.seconds), collections.defaultdict(list)
        return taken

    def _timed(self, function: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started, cpu_started = time.perf_counter(), time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label].append(time.perf_counter() - started)
                # The calling thread's own CPU time: what it spends, not what it waits (the GIL).
                self.seconds[f"{label} cpu"].append(time.thread_time() - cpu_started)
        return timed


class SplitClock(engine.Callback):
    """When each split ended (``time.perf_counter``)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_split_end(self, view: engine.RunView) -> None:
        self.ends.append(time.perf_counter())

    def per_split_seconds(self) -> float:
        """Steady state: first to last split end, over the splits in between (each with its
        checkpoint); the end of the run is left out."""
        return (self.ends[-1] - self.ends[0]) / max(1, len(self.ends) - 1)


# ---- one run ------------------------------------------------------------------------------------
@dataclasses.dataclass
class RunResult:
    seconds: float
    per_split_seconds: float
    timers: dict[str, list[float]]
    model: LanguageModel | None
    # Process CPU time (every thread, user and system) of the run: less sensitive than wall
    # time to what other processes do on a shared machine.
    cpu_seconds: float = 0.0
    # CPU time (user and system) of the child processes the run waited for: its writer process.
    child_cpu_seconds: float = 0.0


def checkpoint_policy(way: str, local_tier: str | None = None) -> engine.CheckpointConfig | None:
    if way in ("none", "floor"):
        return None
    if way == "fast":
        return engine.CheckpointConfig(every_n_splits=1, keep_last=2, writer="thread", local_tier=local_tier,
                                       durable_every_seconds=60.0)
    if way == "process":
        # "Latest wins": training never waits for the writer process (a snapshot not yet taken
        # up is replaced by a newer one); the run's last checkpoint is always written.
        return engine.CheckpointConfig(every_n_splits=1, keep_last=2, writer="process",
                                       when_behind="skip")
    return engine.CheckpointConfig(every_n_splits=1, keep_last=2, writer="thread" if way == "async" else "sync")


class CopyFloor(engine.Callback):
    """The floor of a split-level snapshot: one plain ``copy_`` of the model's and the
    optimizer's tensors into buffers allocated at the first split, after every split."""

    def __init__(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        self.model = model
        self.optimizers = optimizers
        self.buffers: list[torch.Tensor] | None = None

    def on_split_end(self, view: engine.RunView) -> None:
        tensors = list(self.model.state_dict().values())
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
        if self.buffers is None or len(self.buffers) != len(tensors):
            self.buffers = [torch.empty_like(tensor) for tensor in tensors]
        for buffer, tensor in zip(self.buffers, tensors):
            buffer.copy_(tensor)


def timed_run(workload: Workload, way: str, batches: list[Batch], work: str, timers: CheckpointTimers,
              max_steps: int | None = None) -> RunResult:
    """One fresh run of ``way`` in a fresh run directory (model built outside the timing)."""
    model = fresh_model(workload)
    run_dir = None if way in ("none", "floor") else tempfile.mkdtemp(prefix=f"{workload.label}-{way}-", dir=work)
    local_tier = tempfile.mkdtemp(prefix=f"splitloop-bench-{workload.label}-", dir=FAST_TIER_ROOT) if way == "fast" else None
    config = engine.TrainerConfig(max_epochs=1, max_steps=max_steps, run_dir=run_dir,
                                  checkpoint=checkpoint_policy(way, local_tier), progress_bar="off")
    clock = SplitClock()
    callbacks: list[engine.Callback] = [clock]
    if way == "floor":
        optimizers: list[torch.optim.Optimizer] = []
        configure = model.configure_optimizers

        def configure_and_remember() -> torch.optim.Optimizer:
            optimizer = configure()
            optimizers.append(optimizer)
            return optimizer

        model.configure_optimizers = configure_and_remember  # type: ignore[method-assign]
        callbacks.append(CopyFloor(model, optimizers))
    os.sync()
    timers.take()
    started, cpu_started, child_started = time.perf_counter(), time.process_time(), children_cpu_seconds()
    engine.Trainer(config, callbacks=callbacks).fit(model, batches, resume="off")
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    child_cpu_seconds = children_cpu_seconds() - child_started
    recorded = timers.take()
    if run_dir is not None:
        shutil.rmtree(run_dir)
    if local_tier is not None:
        shutil.rmtree(local_tier)
    return RunResult(seconds, clock.per_split_seconds(), recorded, model, cpu_seconds, child_cpu_seconds)


def children_cpu_seconds() -> float:
    """User and system CPU seconds of the child processes waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def same_parameters(models: list[torch.nn.Module]) -> bool:
    first = models[0].state_dict()
    return all(torch.equal(first[key], other.state_dict()[key]) for other in models[1:] for key in first)


def interleaved_rounds(ways: list[str], repeats: int, run: Callable[[str, int | None], Any]) -> Iterator[tuple[int, dict]]:
    """``run(way, max_steps)`` for every way once with ``max_steps=1`` (a warm-up: the first-call
    costs of each way), then ``repeats`` rounds of the ways back to back, the first way
    rotating from round to round; yields each round's index and ``{way: result}``."""
    for way in ways:
        run(way, 1)
    for index in range(repeats):
        order = ways[index % len(ways):] + ways[:index % len(ways)]
        yield index, {way: run(way, None) for way in order}


def finish_round(workload: Workload, results: dict[str, Any], equal: bool) -> None:
    """Refuse a round whose ways trained different parameters, then drop the models."""
    if not equal:
        raise RuntimeError(f"{workload.label}: checkpointing changed the trained parameters")
    for result in results.values():
        result.model = None  # keep memory flat: 25M-parameter models are 100 MB each


def run_rounds(workload: Workload, repeats: int, work: str, timers: CheckpointTimers) -> list[dict[str, RunResult]]:
    """``repeats`` interleaved rounds of the ways."""
    batches = make_batches(workload)
    rounds = []
    for index, results in interleaved_rounds(
            WAYS, repeats, lambda way, max_steps: timed_run(workload, way, batches, work, timers, max_steps)):
        equal = same_parameters([results[way].model for way in WAYS])
        print(f"  round {index + 1}: " + ", ".join(f"{way} {results[way].seconds:.2f} s" for way in WAYS)
              + f"; sync/none {results['sync'].seconds / results['none'].seconds:.3f}, "
              f"async/none {results['async'].seconds / results['none'].seconds:.3f}, "
              f"process/none {results['process'].seconds / results['none'].seconds:.3f}, "
              f"fast/none {results['fast'].seconds / results['none'].seconds:.3f}, "
              f"floor/none {results['floor'].seconds / results['none'].seconds:.3f}; parameters equal: {equal}")
        finish_round(workload, results, equal)
        rounds.append(results)
    return rounds


# ---- reporting the runs -------------------------------------------------------------------------
def median_ratio(rounds: list[dict[str, RunResult]], way: str, field: str = "seconds") -> float:
    """Median of the per-round ratios ``way`` / none (see the module docstring)."""
    return statistics.median(getattr(r[way], field) / getattr(r["none"], field) for r in rounds)


def median_per_checkpoint(rounds: list[dict[str, RunResult]], way: str, label: str) -> float:
    """Median seconds of one call of ``label`` over every checkpoint of every round of ``way``."""
    values = [value for r in rounds for value in r[way].timers.get(label, [])]
    return statistics.median(values) if values else 0.0


def report_runs(workload: Workload, rounds: list[dict[str, RunResult]]) -> dict[str, float]:
    """Print the run figures of one model; returns the ratios to no checkpoints per way."""
    wall = {way: statistics.median(r[way].seconds for r in rounds) for way in WAYS}
    split = {way: statistics.median(r[way].per_split_seconds for r in rounds) for way in WAYS}
    checkpoints = len(rounds[0]["sync"].timers.get("save", []))
    print(f"{workload.label}: median wall time none {wall['none']:.3f} s, sync {wall['sync']:.3f} s, "
          f"async {wall['async']:.3f} s ({checkpoints} checkpoints per run)")
    print(f"{workload.label}: ratio sync/none {median_ratio(rounds, 'sync'):.3f}, "
          f"async/none {median_ratio(rounds, 'async'):.3f} (medians of {len(rounds)} per-round ratios)")
    print(f"{workload.label}: steady state per split none {split['none'] * 1e3:.1f} ms, "
          f"sync {split['sync'] * 1e3:.1f} ms, async {split['async'] * 1e3:.1f} ms; ratio sync/none "
          f"{median_ratio(rounds, 'sync', 'per_split_seconds'):.3f}, async/none "
          f"{median_ratio(rounds, 'async', 'per_split_seconds'):.3f}, process/none "
          f"{median_ratio(rounds, 'process', 'per_split_seconds'):.3f}, fast/none "
          f"{median_ratio(rounds, 'fast', 'per_split_seconds'):.3f}, floor/none "
          f"{median_ratio(rounds, 'floor', 'per_split_seconds'):.3f} (end of run left out)")
    print(f"{workload.label}: fast tier (async, every split to {FAST_TIER_ROOT}, durable every 60 s and at the end) "
          f"/ none {median_ratio(rounds, 'fast'):.3f}; copy floor (one copy_ of the state per split) / none "
          f"{median_ratio(rounds, 'floor'):.3f}")
    report_checkpoint_breakdown(workload, rounds)
    ratios = {way: median_ratio(rounds, way) for way in WAYS if way != "none"}
    ratios.update({f"{way} per split": median_ratio(rounds, way, "per_split_seconds") for way in WAYS if way != "none"})
    return ratios


def report_checkpoint_breakdown(workload: Workload, rounds: list[dict[str, RunResult]]) -> None:
    """Where one checkpoint's time goes, medians over every checkpoint of every round."""
    def ms(way: str, label: str) -> float:
        return median_per_checkpoint(rounds, way, label) * 1e3

    print(f"{workload.label}: per sync checkpoint, training thread blocked {ms('sync', 'save'):.1f} ms "
          f"(encode {ms('sync', 'encode'):.1f} ms, write and commit {ms('sync', 'commit'):.1f} ms)")
    checkpoints = len(rounds[0]["sync"].timers.get("save", [])) or 1
    cpu = {way: statistics.median((r[way].cpu_seconds - r["none"].cpu_seconds) / checkpoints for r in rounds) * 1e3
           for way in ("sync", "async", "fast")}
    print(f"{workload.label}: CPU time per checkpoint (process, every thread, minus the run without checkpoints; "
          f"medians per round): sync {cpu['sync']:.1f} ms, async {cpu['async']:.1f} ms, fast tier {cpu['fast']:.1f} ms")
    process_cpu = statistics.median(r["process"].child_cpu_seconds / checkpoints for r in rounds) * 1e3
    print(f"{workload.label}: writer process (writer='process'): training thread CPU per checkpoint "
          f"{ms('process', 'save cpu'):.2f} ms (copy into shared memory {ms('process', 'capture cpu'):.2f} ms, "
          f"encode {ms('process', 'encode cpu'):.2f} ms), writer process CPU per checkpoint {process_cpu:.2f} ms "
          f"(its start included)")
    print(f"{workload.label}: training thread CPU per checkpoint (FitRun._save, time.thread_time, medians): "
          f"sync {ms('sync', 'save cpu'):.2f} ms, async {ms('async', 'save cpu'):.2f} ms (copy into buffers "
          f"{ms('async', 'capture cpu'):.2f} ms), fast tier {ms('fast', 'save cpu'):.2f} ms")
    capture, submit = ms("async", "capture"), ms("async", "submit")
    print(f"{workload.label}: per async checkpoint, training thread blocked {ms('async', 'save'):.1f} ms "
          f"(encode {ms('async', 'encode'):.1f} ms, submit {submit:.1f} ms = copy into buffers {capture:.1f} ms "
          f"+ wait for the writer ~{submit - capture:.1f} ms); background write and commit "
          f"{ms('async', 'commit'):.1f} ms")


# ---- blocking time against a plain copy ---------------------------------------------------------
def trained_state_tree(workload: Workload) -> dict[str, Any]:
    """What ``FitRun._state_tree`` holds that has tensors: module, Adam after two steps, RNG."""
    model = fresh_model(workload)
    config = engine.TrainerConfig(max_steps=2, run_dir=None, checkpoint=None, progress_bar="off")
    engine.Trainer(config).fit(model, make_batches(workload)[:1], resume="off")
    optimizer = model._engine_optimizers[0]
    return {"module": model.state_dict(), "optimizers": [optimizer.state_dict()],
            "rng": capture_global_rng().to_state()}


def time_call(function: Callable[[], object]) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def interleaved_pairs(first: Callable[[], float], second: Callable[[], float], repeats: int) -> Iterator[tuple[float, float]]:
    """``repeats`` pairs (first, second) timed back to back; odd pairs run second first."""
    for index in range(repeats):
        if index % 2 == 0:
            a = first()
            yield a, second()
        else:
            b = second()
            yield first(), b


def report_blocking(workload: Workload, rounds: list[dict[str, RunResult]] | None, repeats: int) -> float:
    """Print the asynchronous blocking time against a clone; returns the micro-benchmark ratio."""
    tree = trained_state_tree(workload)
    encoded = encode_state(tree)
    tensors, layout = encoded.tensors, encoded.layout
    megabytes = sum(t.numel() * t.element_size() for t in tensors) / 1e6
    buffers = SnapshotBuffers()
    buffers.capture(tensors, layout)  # warm-up: allocates the buffer the engine then reuses
    floor = [torch.empty_like(t) for t in tensors]
    for _ in range(2):  # warm-up: the allocator settles (glibc first maps, then reuses, big blocks)
        [t.clone() for t in tensors]

    def blocking() -> float:
        def encode_and_capture() -> None:
            encoded = encode_state(tree)
            buffers.capture(encoded.tensors, encoded.layout)

        return time_call(encode_and_capture)

    def clone() -> float:
        return time_call(lambda: [t.clone() for t in tensors])

    pairs = list(interleaved_pairs(blocking, clone, repeats))
    copy_ms = statistics.median(time_call(lambda: [b.copy_(t) for b, t in zip(floor, tensors)]) for _ in range(repeats)) * 1e3
    blocking_ms = statistics.median(b for b, _ in pairs) * 1e3
    clone_ms = statistics.median(c for _, c in pairs) * 1e3
    ratio = statistics.median(b / c for b, c in pairs)
    # A clone's cost depends on the allocator: fresh pages (a page fault per 4 KiB) or reused
    # ones; the copy_ into preallocated tensors is the floor that does not.
    print(f"{workload.label}: blocking per async checkpoint, {len(tensors)} tensors, {megabytes:.1f} MB: "
          f"encode_state + capture {blocking_ms:.2f} ms, clone {clone_ms:.2f} ms, ratio {ratio:.3f} "
          f"(goal <= 1.2); copy_ into preallocated tensors {copy_ms:.2f} ms (the floor, "
          f"ratio to it {blocking_ms / copy_ms:.3f})")
    if rounds is not None:
        real_ms = median_per_checkpoint(rounds, "async", "save") * 1e3
        print(f"{workload.label}: in the runs, FitRun._save per async checkpoint {real_ms:.2f} ms "
              f"= {real_ms / clone_ms:.3f} x the clone")
    return ratio


# ---- entry point --------------------------------------------------------------------------------
def parse_arguments(description: str = __doc__, default_repeats: int = 3) -> argparse.Namespace:
    """The options of the checkpoint benchmarks (this one and checkpoint_budget.py)."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"interleaved rounds per model (default {default_repeats}, 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="one round of shorter runs")
    parser.add_argument("--smoke", action="store_true", help="every way once on tiny models (CI runs it; the figures mean nothing)")
    parser.add_argument("--dir", default=None, help="where to create the temporary directory (default: the current directory)")
    arguments = parser.parse_args()
    if arguments.repeats is None:
        arguments.repeats = 1 if arguments.quick or arguments.smoke else default_repeats
    if arguments.repeats < 1:
        parser.error("--repeats must be positive")
    return arguments


def scratch_directory(prefix: str, parent: str | None, settings: str = "") -> str:
    """A new temporary directory under ``parent`` (default: the current directory), announced
    with the torch build and ``settings``; a warning when it is in memory, where fsync is free."""
    work = os.path.abspath(tempfile.mkdtemp(prefix=prefix, dir=parent or os.getcwd()))
    kind = filesystem_type(work)
    print(f"temporary directory {work} ({kind}), torch {torch.__version__}, torch threads {THREADS}{settings}")
    if kind in ("tmpfs", "ramfs"):
        print(f"warning: {work} is in memory ({kind}); fsync costs nothing there, pass --dir on a disk")
    return work


def filesystem_type(path: str) -> str:
    """The type of the filesystem ``path`` is on, from /proc/mounts (longest mount prefix)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                mount_point = fields[1]
                if (path == mount_point or path.startswith(mount_point.rstrip("/") + "/")) and len(mount_point) > len(best):
                    best, kind = mount_point, fields[2]
    except OSError:
        pass
    return kind


def smoke_workloads() -> list[Workload]:
    """The two workloads at their smallest (``--smoke``): the "25M" label is kept, the model is not."""
    return [dataclasses.replace(SMALL, batches=1, sequence_length=64),
            dataclasses.replace(LARGE, vocabulary=64, embedding=16, hidden=16, batches=1, sequence_length=32)]


def workloads(arguments: argparse.Namespace) -> list[Workload]:
    if arguments.smoke:
        return smoke_workloads()
    if not arguments.quick:
        return [SMALL, LARGE]
    return [dataclasses.replace(SMALL, batches=3), dataclasses.replace(LARGE, batches=1, sequence_length=32)]


def main() -> None:
    arguments = parse_arguments()
    torch.set_num_threads(THREADS)
    work = scratch_directory("checkpoint_overhead-", arguments.dir)
    timers = CheckpointTimers()
    timers.install()
    ratios: dict[str, dict[str, float]] = {}
    try:
        for workload in workloads(arguments):
            splits = workload.batches * workload.sequence_length // workload.split_length
            parameters = sum(p.numel() for p in fresh_model(workload).parameters())
            print(f"{workload.label}: LSTM {workload.layers}x{workload.hidden}, {parameters / 1e6:.2f}M parameters, "
                  f"{workload.batches} batches of {workload.batch_size}x{workload.sequence_length}, "
                  f"{splits} splits of {workload.split_length} per run")
            rounds = run_rounds(workload, arguments.repeats, work, timers)
            ratios[workload.label] = report_runs(workload, rounds)
            report_blocking(workload, rounds, repeats=1 if arguments.smoke else 5 if arguments.quick else 9)
    finally:
        timers.uninstall()
        shutil.rmtree(work, ignore_errors=True)
    print(f"async every-split overhead ratio: {ratios['25M']['async']:.3f} (async every split / no checkpoints, 25M model)")
    print(f"fast-tier wall-time ratio: {ratios['25M']['fast']:.3f} (floor {ratios['25M']['floor']:.3f}; 25M model; "
          "includes making the run's last checkpoint durable, which fit waits for)")
    print(f"small async every-split overhead ratio: {ratios['small']['async']:.3f} (async every split / no checkpoints, small model)")
    print(f"small async every-split overhead ratio (writer process): {ratios['small']['process']:.3f} "
          "(writer='process', every split / no checkpoints, small model)")
    print(f"fast-tier every-split overhead ratio: {ratios['25M']['fast per split']:.3f} "
          f"(floor {ratios['25M']['floor per split']:.3f}; 25M model)")


if __name__ == "__main__":
    main()
