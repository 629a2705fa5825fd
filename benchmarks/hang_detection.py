"""The watchdog (docs/faults.md, "Hangs"): how fast it sees a hang, whether it ever sees one that is
not there, and what it costs the loop.

Three figures, each measured side by side in this run:

* **detection latency / p99 split time**: a child process trains a small LSTM (TBPTT, a checkpoint
  every split) whose splits take the time of a real accelerator step: ``--device-ms`` of emulated
  device time in the forward pass and twice that in the backward pass (a sleep, as a GPU step
  leaves the training thread waiting). Its watchdog is the default one (``factor`` 5) with a floor
  ``min_timeout_s=--min-timeout`` below the learned timeouts, so that what is measured is the
  learned per-phase timeout (the default 300 s floor governs any phase shorter than a minute).
  One hang is armed at a random split after the warm-up, of each kind: a hang in the user's step
  (``step_start``), a storage write that never returns (``filesystem_write``, writer thread) and
  a writer process stopped by SIGSTOP (``checkpoint_before_file``, ``writer="process"``). The
  latency is the hang report's ``stalled_s``: how long the hung phase had lasted when the watchdog
  ended the process (for a writer, from when the write it waited for began). The p99 split time is
  that of the child's splits before the hang, timed by a callback. Printed per hang and as the
  median over every injected hang.
* **false hang verdicts**: a child trains ``--splits`` splits of the LSTM on the CPU alone (no
  device time: about 7 ms a split) with ``min_timeout_s=1`` beside CPU hogs and an fsync storm (a
  process writing and fsyncing 1 MiB in a loop): the count of ``hangs.jsonl`` rows (a verdict ends
  the child, so a verdict also shows as a short run). A detection child whose report comes before
  its armed hang counts as a false verdict too, its splits with it.
* **loop with watchdog / without**: the same in-process fit (``--cost-device-ms`` of device time)
  with ``watchdog=Watchdog()`` and ``watchdog=None``, interleaved in pairs (the order
  alternating): one plus the median of the pairs' differences over the median time without. The
  same on CPU-only splits of about 1 ms, the worst case, with the watchdog's cost per split.

Reproduce (from the repository root)::

    python benchmarks/hang_detection.py                 # 10,000 splits; about 10 minutes on 2 cores
    python benchmarks/hang_detection.py --quick         # a smoke run
    python benchmarks/hang_detection.py --false-positives [--splits N] [--hogs H]
                                                        # the false-positive run alone

``--false-positives`` runs only the second figure, at ``--splits`` (10,000) splits beside ``--hogs``
CPU hogs (one per core by default) and the fsync storm, and also prints how much the load made the
split times jitter (``split time p99 / p50``: the goal is 0 verdicts at 2x and more). Run it on a
machine nobody else loads: on a shared one the other jobs' stalls are part of what it measures.

The last three lines are ``detection latency / p99 split time: X``, ``false hang verdicts: N in M
splits`` and ``loop with watchdog / without: Y``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time

REPOSITORY = str(pathlib.Path(__file__).resolve().parents[1])


def build(seed: int, splits: int, device_ms: float = 0.0) -> tuple[object, object]:
    """A small LSTM and its loader for ``splits`` splits; ``device_ms`` of emulated device time in
    each forward pass and twice that in each backward pass."""
    import torch

    import engine

    class DeviceTime(torch.autograd.Function):
        """The identity, taking the time an accelerator would: the training thread waits."""

        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            time.sleep(device_ms / 1000)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            time.sleep(2 * device_ms / 1000)
            return grad

    class Model(engine.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tbptt_split_length = 8
            self.rnn = torch.nn.LSTM(4, 16, batch_first=True)
            self.head = torch.nn.Linear(16, 1)

        def training_step(self, batch, hidden=None):  # type: ignore[no-untyped-def]
            x, y = batch
            out, hidden = self.rnn(x, hidden)
            if device_ms:
                out = DeviceTime.apply(out)
            return torch.nn.functional.mse_loss(self.head(out), y), hidden

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(seed)
    batches = max(1, splits // 4)
    x = torch.randn(batches * 2, 32, 4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.cumsum(1)[..., :1] * 0.1), batch_size=2)
    return Model(), loader


def child(arguments: argparse.Namespace) -> int:
    """Train ``--splits`` splits under a test-sized watchdog, recording each split's duration."""
    import torch

    import engine

    torch.set_num_threads(1)

    class SplitTimes(engine.Callback):
        def __init__(self) -> None:
            self.last = time.perf_counter()
            self.handle = open(arguments.times, "a", buffering=1)

        def on_split_end(self, view: engine.RunView) -> None:
            now = time.perf_counter()
            self.handle.write(f"{now - self.last:.6f}\n")
            self.last = now

    model, loader = build(0, arguments.splits, arguments.device_ms)
    watchdog = engine.Watchdog(min_timeout_s=arguments.min_timeout, first_timeout_s=60.0,
                               poll_s=min(0.05, arguments.min_timeout / 10))
    config = engine.TrainerConfig(max_epochs=1, run_dir=arguments.child, progress_bar="off", watchdog=watchdog,
                                  checkpoint=engine.CheckpointConfig(writer=arguments.writer))
    engine.Trainer(config, callbacks=[SplitTimes()]).fit(model, loader)  # type: ignore[arg-type]
    return 0


def run_child(directory: str, splits: int, min_timeout: float, device_ms: float = 0.0, writer: str = "thread",
              faults: str | None = None) -> tuple[int, list[dict], list[float]]:
    run_dir, times = os.path.join(directory, "run"), os.path.join(directory, "times")
    env = {**os.environ, "PYTHONPATH": REPOSITORY + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("SPLITLOOP_FAULTS", None)
    if faults:
        env["SPLITLOOP_FAULTS"] = faults
    process = subprocess.run([sys.executable, __file__, "--child", run_dir, "--splits", str(splits),
                              "--min-timeout", str(min_timeout), "--device-ms", str(device_ms), "--writer", writer,
                              "--times", times], env=env, capture_output=True, text=True)
    hangs = pathlib.Path(run_dir, "hangs.jsonl")
    rows = [json.loads(line) for line in hangs.read_text().splitlines()] if hangs.exists() else []
    durations = [float(line) for line in pathlib.Path(times).read_text().split()] if os.path.exists(times) else []
    return process.returncode, rows, durations


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


# The injected hangs (fault point, kind, writer), each armed at a random split between WARMED and
# twice that: after every phase's warm-up (10 samples).
HANGS = (("step_start", "hang", "thread"), ("filesystem_write", "hang", "thread"),
         ("checkpoint_before_file", "sigstop", "process"))
WARMED = 15
# The false-positive run's floor: its 7 ms splits are far below any learned timeout, so the floor
# is what a stall of a loaded machine must not reach.
FALSE_POSITIVE_MIN_TIMEOUT = 1.0


def reaches_per_split(points: list[str], splits: int = 16) -> dict[str, float]:
    """How many times a run reaches each of ``points`` per split (a checkpoint writes several
    files), counted in a short in-process run with a thread writer; a writer process reaches the
    checkpoint points as often."""
    import torch

    import engine
    from engine.faults import points as fault_points

    torch.set_num_threads(1)
    model, loader = build(0, splits)
    never = ",".join(f"{point}:{1 << 40}:raise" for point in points)
    saved = os.environ.get("SPLITLOOP_FAULTS")
    os.environ["SPLITLOOP_FAULTS"] = never
    try:
        with tempfile.TemporaryDirectory() as directory:
            config = engine.TrainerConfig(max_epochs=1, run_dir=directory, progress_bar="off", watchdog=None)
            engine.Trainer(config).fit(model, loader)  # type: ignore[arg-type]
        return {point: fault_points.arrivals(point) / splits for point in points}
    finally:
        fault_points.clear()
        if saved is None:
            os.environ.pop("SPLITLOOP_FAULTS", None)
        else:
            os.environ["SPLITLOOP_FAULTS"] = saved


def detection(hangs: int, min_timeout: float, device_ms: float, rng: random.Random) -> tuple[float, int, int]:
    """The median ratio over every injected hang, the false verdicts met before an armed hang,
    and the splits trained before the hangs."""
    ratios: list[float] = []
    false, trained = 0, 0
    per_split = reaches_per_split([point for point, _, _ in HANGS])
    for point, kind, writer in HANGS:
        for _ in range(hangs):
            split = rng.randint(WARMED, 2 * WARMED)
            reach = max(1, round(split * per_split[point]))
            with tempfile.TemporaryDirectory() as directory:
                code, rows, durations = run_child(directory, 4 * WARMED, min_timeout, device_ms, writer,
                                                  f"{point}:{reach}:{kind}")
            trained += len(durations)
            if not rows or len(durations) < 2:
                print(f"  {point}:{kind}: no hang report (exit {code})")
                continue
            row = rows[0]
            if row["last_split"] < split - 2:  # reported before the hang was armed: a false verdict
                false += 1
                print(f"  {point}:{kind}: armed at split {split}, but a verdict after split {row['last_split']} "
                      f"in {row['phase']!r}: a false verdict")
                continue
            steady = p99(durations[1:])  # the first split compiles and warms caches
            ratio = row["stalled_s"] / steady
            ratios.append(ratio)
            print(f"  {point}:{kind} ({writer} writer): hung in {row['phase']!r} after split {row['last_split']}, "
                  f"detected after {row['stalled_s']:.2f} s (timeout {row['timeout_s']:.2f} s); p99 split "
                  f"{steady * 1000:.0f} ms; ratio {ratio:.2f}")
    return (statistics.median(ratios) if ratios else float("nan")), false, trained


def false_verdicts(splits: int, min_timeout: float, hog_count: int = 2) -> tuple[int, list[float]]:
    """Hang verdicts in a run of ``splits`` splits beside ``hog_count`` CPU hogs and an fsync
    storm, and the run's split durations."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hog_count)]
    storm_code = ("import os, sys\nwhile True:\n    with open(sys.argv[1], 'wb') as f:\n"
                  "        f.write(os.urandom(1 << 20)); f.flush(); os.fsync(f.fileno())\n")
    with tempfile.TemporaryDirectory() as directory:
        hogs.append(subprocess.Popen([sys.executable, "-c", storm_code, os.path.join(directory, "storm")]))
        try:
            _, rows, durations = run_child(directory, splits, min_timeout)  # CPU only, a writer thread
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
    return len(rows), durations


def cost(pairs: int, splits: int, device_ms: float) -> tuple[float, float]:
    """The ratio of a fit of ``splits`` splits (``device_ms`` of device time) with the default
    watchdog to one without (see the module docstring), and the watchdog's added seconds per split."""
    import torch

    import engine

    torch.set_num_threads(1)

    def once(watchdog: object) -> float:
        model, loader = build(0, splits, device_ms)
        config = engine.TrainerConfig(max_epochs=1, progress_bar="off", watchdog=watchdog)  # type: ignore[arg-type]
        start = time.perf_counter()
        engine.Trainer(config).fit(model, loader)  # type: ignore[arg-type]
        return time.perf_counter() - start

    once(None)
    extra, bare = [], []
    for index in range(pairs):
        if index % 2:
            without, with_ = once(None), once(engine.Watchdog())
        else:
            with_, without = once(engine.Watchdog()), once(None)
        extra.append(with_ - without)
        bare.append(without)
    # The median of the pairs' differences over the median time without: a slow moment of the
    # machine lands in one run of a pair and moves one difference, where a median of the pairs'
    # ratios let such moments decide (on 1 ms splits they are larger than the watchdog itself).
    return 1 + statistics.median(extra) / statistics.median(bare), statistics.median(extra) / splits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (few splits, one hang per kind)")
    parser.add_argument("--splits", type=int, default=10_000, help="splits of the false-positive run")
    parser.add_argument("--hangs", type=int, default=3, help="hangs injected per kind")
    parser.add_argument("--device-ms", type=float, default=200.0,
                        help="emulated device time of a forward pass in the detection runs (backward: twice it)")
    parser.add_argument("--min-timeout", type=float, default=0.5,
                        help="the watchdog's min_timeout_s in the detection runs (below the learned timeouts)")
    parser.add_argument("--cost-device-ms", type=float, default=10.0,
                        help="emulated device time of a forward pass in the cost runs")
    parser.add_argument("--false-positives", action="store_true",
                        help="only the false-positive run: --splits splits beside CPU hogs and an fsync storm")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="CPU hogs of --false-positives "
                        "(default: one per core)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--times", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--writer", default="thread", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args)
    if args.splits < 1 or args.hogs < 0 or args.min_timeout <= 0 or args.device_ms < 0 or args.cost_device_ms < 0:
        parser.error("--splits must be positive, --hogs, --device-ms and --cost-device-ms not negative, "
                     "--min-timeout positive")
    if args.false_positives:
        verdicts, durations = false_verdicts(args.splits, FALSE_POSITIVE_MIN_TIMEOUT, args.hogs)
        steady = sorted(durations[1:]) or [float("nan")]  # the first split compiles and warms caches
        print(f"split time p50: {steady[len(steady) // 2] * 1000:.1f} ms, p99: {p99(steady) * 1000:.1f} ms, max: "
              f"{steady[-1] * 1000:.1f} ms ({args.hogs} CPU hogs and an fsync storm beside it)")
        print(f"split time p99 / p50: {p99(steady) / steady[len(steady) // 2]:.2f}")
        print(f"false hang verdicts: {verdicts} in {len(durations)} splits")
        return 0 if verdicts == 0 else 1
    splits, hangs, pairs = (200, 1, 3) if args.quick else (args.splits, args.hangs, 9)
    rng = random.Random(0)
    print(f"detection: {args.device_ms:g} ms of device time forward, {2 * args.device_ms:g} ms backward; "
          f"Watchdog(min_timeout_s={args.min_timeout:g}), the default factor")
    latency, early, before_hangs = detection(hangs, args.min_timeout, args.device_ms, rng)
    verdicts, durations = false_verdicts(splits, FALSE_POSITIVE_MIN_TIMEOUT)
    print(f"  false-positive run: {len(durations)} CPU-only splits, Watchdog(min_timeout_s="
          f"{FALSE_POSITIVE_MIN_TIMEOUT:g}), 2 CPU hogs and an fsync storm: {verdicts} verdicts")
    cost_splits = 40 if args.quick else 300
    ratio, per_split = cost(pairs, cost_splits, args.cost_device_ms)
    cpu_ratio, cpu_per_split = cost(pairs, 400 if args.quick else 2000, 0.0)
    print(f"  cost on CPU-only splits of about 1 ms (the worst case): {cpu_ratio:.3f}, "
          f"{cpu_per_split * 1e6:.1f} us per split")
    print(f"  cost on splits with {args.cost_device_ms:g} ms of device time forward: {per_split * 1e6:.1f} us per split")
    print(f"detection latency / p99 split time: {latency:.2f}")
    print(f"false hang verdicts: {verdicts + early} in {len(durations) + before_hangs} splits")
    print(f"loop with watchdog / without: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
