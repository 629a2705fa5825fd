"""The watchdog (docs/faults.md, "Hangs"): how fast it sees a hang, whether it ever sees one that is
not there, and what it costs the loop.

Three figures, each measured side by side in this run:

* **detection latency / p99 split time**: a child process trains a small LSTM (TBPTT, a checkpoint
  every split) with ``Watchdog(min_timeout_s=--min-timeout)`` and a ``hang`` fault armed at a random
  split: in the user's step (``step_start``), and in a storage write (``filesystem_write``). The
  latency is the hang report's ``stalled_s`` (how long the phase had lasted when the watchdog ended
  the process); the p99 split time is that of the child's splits before the hang, timed by a
  callback. Printed per kind and as the median over every injected hang.
* **false hang verdicts**: a child trains ``--splits`` splits under the same watchdog beside two
  CPU hogs and an fsync storm (a process writing and fsyncing 1 MiB in a loop): the count of
  ``hangs.jsonl`` rows (a verdict ends the child, so a verdict also shows as a short run).
* **loop with watchdog / without**: the same in-process fit with ``watchdog=Watchdog()`` and
  ``watchdog=None``, interleaved in pairs (the order alternating): one plus the median of the
  pairs' differences over the median time without.

Reproduce (from the repository root)::

    python benchmarks/hang_detection.py                 # 10,000 splits; several minutes on 2 cores
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


def build(seed: int, splits: int) -> tuple[object, object]:
    import torch

    import engine

    class Model(engine.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tbptt_split_length = 8
            self.rnn = torch.nn.LSTM(4, 16, batch_first=True)
            self.head = torch.nn.Linear(16, 1)

        def training_step(self, batch, hidden=None):  # type: ignore[no-untyped-def]
            x, y = batch
            out, hidden = self.rnn(x, hidden)
            return torch.nn.functional.mse_loss(self.head(out), y), hidden

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(seed)
    batches = max(1, splits // 4)
    x = torch.randn(batches * 2, 32, 4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.cumsum(1)[..., :1] * 0.1), batch_size=2)
    return Model(), loader


def child(run_dir: str, splits: int, min_timeout: float, times_path: str) -> int:
    """Train ``splits`` splits under a test-sized watchdog, recording each split's duration."""
    import torch

    import engine

    torch.set_num_threads(1)

    class SplitTimes(engine.Callback):
        def __init__(self) -> None:
            self.last = time.perf_counter()
            self.handle = open(times_path, "a", buffering=1)

        def on_split_end(self, view: engine.RunView) -> None:
            now = time.perf_counter()
            self.handle.write(f"{now - self.last:.6f}\n")
            self.last = now

    model, loader = build(0, splits)
    config = engine.TrainerConfig(max_epochs=1, run_dir=run_dir, progress_bar="off",
                                  watchdog=engine.Watchdog(min_timeout_s=min_timeout, first_timeout_s=60.0,
                                                           poll_s=min(0.05, min_timeout / 10)))
    engine.Trainer(config, callbacks=[SplitTimes()]).fit(model, loader)
    return 0


def run_child(directory: str, splits: int, min_timeout: float, faults: str | None = None) -> tuple[int, list[dict], list[float]]:
    run_dir, times = os.path.join(directory, "run"), os.path.join(directory, "times")
    env = {**os.environ, "PYTHONPATH": REPOSITORY + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("SPLITLOOP_FAULTS", None)
    if faults:
        env["SPLITLOOP_FAULTS"] = faults
    process = subprocess.run([sys.executable, __file__, "--child", run_dir, "--splits", str(splits),
                              "--min-timeout", str(min_timeout), "--times", times], env=env,
                             capture_output=True, text=True)
    hangs = pathlib.Path(run_dir, "hangs.jsonl")
    rows = [json.loads(line) for line in hangs.read_text().splitlines()] if hangs.exists() else []
    durations = [float(line) for line in pathlib.Path(times).read_text().split()] if os.path.exists(times) else []
    return process.returncode, rows, durations


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def detection(hangs: int, min_timeout: float, rng: random.Random) -> float:
    ratios: list[float] = []
    for point, low in (("step_start", 20), ("filesystem_write", 60)):
        kind_ratios = []
        for _ in range(hangs):
            with tempfile.TemporaryDirectory() as directory:
                code, rows, durations = run_child(directory, 200, min_timeout, f"{point}:{rng.randint(low, 2 * low)}:hang")
            if not rows or len(durations) < 2:
                print(f"  {point}: no hang report (exit {code})")
                continue
            ratio = rows[0]["stalled_s"] / p99(durations[1:])  # the first split compiles and warms caches
            kind_ratios.append(ratio)
            print(f"  {point}: hung in {rows[0]['phase']!r} after split {rows[0]['last_split']}, detected after "
                  f"{rows[0]['stalled_s']:.2f} s; p99 split {p99(durations[1:]) * 1000:.1f} ms; ratio {ratio:.1f}")
        ratios += kind_ratios
    return statistics.median(ratios) if ratios else float("nan")


def false_verdicts(splits: int, min_timeout: float, hog_count: int = 2) -> tuple[int, list[float]]:
    """Hang verdicts in a run of ``splits`` splits beside ``hog_count`` CPU hogs and an fsync
    storm, and the run's split durations."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hog_count)]
    storm_code = ("import os, sys\nwhile True:\n    with open(sys.argv[1], 'wb') as f:\n"
                  "        f.write(os.urandom(1 << 20)); f.flush(); os.fsync(f.fileno())\n")
    with tempfile.TemporaryDirectory() as directory:
        hogs.append(subprocess.Popen([sys.executable, "-c", storm_code, os.path.join(directory, "storm")]))
        try:
            _, rows, durations = run_child(directory, splits, min_timeout)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
    return len(rows), durations


def cost(pairs: int, splits: int) -> float:
    import torch

    import engine

    torch.set_num_threads(1)

    def once(watchdog: object) -> float:
        model, loader = build(0, splits)
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
    return 1 + statistics.median(extra) / statistics.median(bare)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (few splits, one hang per kind)")
    parser.add_argument("--splits", type=int, default=10_000, help="splits of the false-positive run")
    parser.add_argument("--hangs", type=int, default=3, help="hangs injected per kind")
    parser.add_argument("--min-timeout", type=float, default=1.0, help="the watchdog's min_timeout_s in the children")
    parser.add_argument("--false-positives", action="store_true",
                        help="only the false-positive run: --splits splits beside CPU hogs and an fsync storm")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="CPU hogs of --false-positives "
                        "(default: one per core)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--times", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args.child, args.splits, args.min_timeout, args.times)
    if args.splits < 1 or args.hogs < 0 or args.min_timeout <= 0:
        parser.error("--splits must be positive, --hogs not negative, --min-timeout positive")
    if args.false_positives:
        verdicts, durations = false_verdicts(args.splits, args.min_timeout, args.hogs)
        steady = sorted(durations[1:]) or [float("nan")]  # the first split compiles and warms caches
        print(f"split time p50: {steady[len(steady) // 2] * 1000:.1f} ms, p99: {p99(steady) * 1000:.1f} ms, max: "
              f"{steady[-1] * 1000:.1f} ms ({args.hogs} CPU hogs and an fsync storm beside it)")
        print(f"split time p99 / p50: {p99(steady) / steady[len(steady) // 2]:.2f}")
        print(f"false hang verdicts: {verdicts} in {len(durations)} splits")
        return 0 if verdicts == 0 else 1
    splits, hangs, pairs = (200, 1, 3) if args.quick else (args.splits, args.hangs, 9)
    rng = random.Random(0)
    latency = detection(hangs, args.min_timeout, rng)
    verdicts, durations = false_verdicts(splits, args.min_timeout)
    trained = len(durations)
    ratio = cost(pairs, 400 if args.quick else 2000)
    print(f"detection latency / p99 split time: {latency:.1f}")
    print(f"false hang verdicts: {verdicts} in {trained} splits")
    print(f"loop with watchdog / without: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
