"""Does the goodput model predict a real run? A chaos run measured by its ledger, against the
model (engine.goodput.simulate) fed with that run's own measured costs and failure rate.

* **measured**: two ranks under ``torchrun --max-restarts`` train a small LSTM with TBPTT (a
  checkpoint every ``--every`` splits, each split padded to ``--split-s`` seconds) while this
  script SIGKILLs a random rank at exponential intervals of training time (mean ``--mtbf``
  seconds; the clock stops while the group restarts); torchrun
  restarts the group each time, the engine resumes it exactly. ``python -m engine goodput``'s
  account of the run gives the measured goodput and the sample counts.
* **simulated**: the model with the run's measured checkpoint blocking time, interval between
  commits, restart cost (start-up + restore), down time, hang share and failure rate, over the
  run's wall time, averaged over many trials.

Reproduce (from the repository root)::

    python benchmarks/goodput_validation.py             # 3.4 minutes of training on 2 ranks, a kill every 30 s
    python benchmarks/goodput_validation.py --quick     # 51 s of training, a kill every 15 s
    python benchmarks/goodput_validation.py --smoke     # seconds; its figures mean nothing

The last lines are ``measured goodput: A%``, ``simulated: B%``, ``samples skipped / seen twice:
S / T`` (0 / 0: exact resume) and ``difference: D pp`` (|simulated - measured|; the goal is D <= 2). docs/goodput.md has
the figures of an idle machine.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPOSITORY = str(pathlib.Path(__file__).resolve().parents[1])
SAMPLES, BATCH, TIME, FEATURES, SPLIT = 64, 4, 32, 4, 4
DEFAULT_MTBF = 30.0


def worker(run_dir: str, epochs: int, every: int, split_s: float) -> None:
    """One rank (under torchrun): writes its pid where the killer finds it, then trains."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, REPOSITORY)
    import engine

    class Model(engine.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tbptt_split_length = SPLIT
            self.rnn = torch.nn.LSTM(FEATURES, 16, batch_first=True)
            self.head = torch.nn.Linear(16, 1)

        def training_step(self, batch, hidden=None):  # type: ignore[no-untyped-def]
            x, y = batch
            out, hidden = self.rnn(x, hidden)
            return torch.nn.functional.mse_loss(self.head(out), y), hidden

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Pace(engine.Callback):
        """Each split takes ``split_s`` (a model of a bigger step), and the pid file appears
        once training runs."""

        def __init__(self) -> None:
            self.last = time.monotonic()
            self.announced = False

        def on_split_end(self, view: engine.RunView) -> None:
            if not self.announced:
                pid_file = pathlib.Path(run_dir).parent / f"pid-{os.environ.get('RANK', '0')}"
                pid_file.write_text(str(os.getpid()))
                self.announced = True
            wait = split_s - (time.monotonic() - self.last)
            if wait > 0:
                time.sleep(wait)
            self.last = time.monotonic()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, TIME, FEATURES, generator=generator)
    loader = DataLoader(TensorDataset(x, x.cumsum(dim=1)[..., :1] * 0.1), batch_size=BATCH, shuffle=True)
    config = engine.TrainerConfig(max_epochs=epochs, run_dir=run_dir, progress_bar="off", device="cpu",
                                  checkpoint=engine.CheckpointConfig(every_n_splits=every, keep_last=2))
    pace = Pace()
    engine.Trainer(config, callbacks=[pace]).fit(Model(), loader)
    # Done: no failure strikes a rank that no longer trains.
    pathlib.Path(run_dir).parent.joinpath(f"pid-{os.environ.get('RANK', '0')}").unlink(missing_ok=True)


def chaos_run(work: pathlib.Path, epochs: int, every: int, split_s: float, mtbf: float, seed: int,
              max_restarts: int) -> tuple[int, int]:
    """Run the job under torchrun, SIGKILLing a rank at exponential intervals; returns (kills, status)."""
    run_dir = work / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               f"--max-restarts={max_restarts}", "--monitor-interval=0.1", __file__, "--worker", str(run_dir),
               "--epochs", str(epochs), "--every", str(every), "--split-s", str(split_s)]
    rng = random.Random(seed)
    kills = 0
    with open(work / "torchrun.log", "w") as log:
        job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=str(work), start_new_session=True)
        try:
            # The failure clock runs while both ranks train: a restart is never struck.
            until_kill, last = rng.expovariate(1.0 / mtbf), time.monotonic()
            while job.poll() is None:
                time.sleep(0.02)
                now, elapsed = time.monotonic(), time.monotonic() - last
                last = now
                pid_files = [work / f"pid-{rank}" for rank in range(2)]
                if not all(path.exists() for path in pid_files):
                    continue
                until_kill -= elapsed
                if until_kill > 0:
                    continue
                pid_file = pid_files[rng.randrange(2)]
                pid = int(pid_file.read_text())
                for path in pid_files:
                    path.unlink(missing_ok=True)
                try:
                    os.kill(pid, signal.SIGKILL)
                    kills += 1
                except ProcessLookupError:
                    pass
                until_kill = rng.expovariate(1.0 / mtbf)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return kills, job.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs of 8 batches x 8 splits per rank (default 64: 3.4 min at --split-s 0.05)")
    parser.add_argument("--every", type=int, default=8, help="a checkpoint every N splits (default 8)")
    parser.add_argument("--split-s", type=float, default=0.05, help="seconds per split (default 0.05)")
    parser.add_argument("--mtbf", type=float, default=DEFAULT_MTBF,
                        help=f"mean seconds of training between kills (default {DEFAULT_MTBF:g}; 15 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=4000, help="the model's trials (default 4000)")
    parser.add_argument("--quick", action="store_true", help="about a minute of training")
    parser.add_argument("--smoke", action="store_true", help="seconds; the figures mean nothing")
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.epochs, args.every, args.split_s)
        return 0
    epochs = args.epochs or (1 if args.smoke else 16 if args.quick else 64)
    mtbf = 3.0 if args.smoke else 15.0 if args.quick and args.mtbf == DEFAULT_MTBF else args.mtbf
    split_s = 0.0 if args.smoke else args.split_s
    trials = 50 if args.smoke else args.trials
    sys.path.insert(0, REPOSITORY)
    from engine.checkpoint.store.storage import Storage
    from engine.goodput.account import account
    from engine.goodput.observed import costs_of, model_of
    from engine.goodput.simulate import simulate

    work = pathlib.Path(tempfile.mkdtemp(prefix="goodput-validation-"))
    try:
        kills, status = chaos_run(work, epochs, args.every, split_s, mtbf, args.seed, max_restarts=200)
        if status != 0:
            print((work / "torchrun.log").read_text()[-3000:], file=sys.stderr)
            raise SystemExit(f"the torchrun job ended with {status}")
        found = account(Storage(str(work / "run")))
        assert found is not None
        costs = costs_of(found)
        print(f"chaos run: {kills} SIGKILLs, {len(found.attempts)} attempts, wall {found.wall_s:.1f} s, "
              f"MTBF seen {found.mtbf_s or float('nan'):.1f} s")
        print("buckets: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in found.buckets.items()))
        print(f"measured costs: checkpoint {costs.checkpoint_s or 0:.4f} s every {costs.interval_s or 0:.3f} s, "
              f"restart {costs.restart_s or 0:.2f} s, down {costs.down_s or 0:.2f} s")
        measured = 100 * found.goodput
        if costs.failures_per_hour:
            model = model_of(costs)
            simulated = 100 * simulate(model, costs.interval_s or 0.0, found.wall_s, trials, args.seed).goodput
        else:  # no kill landed (a smoke run can end first): the model without failures
            simulated = measured
        print(f"measured goodput: {measured:.1f}%")
        print(f"simulated: {simulated:.1f}%")
        print(f"samples skipped / seen twice: {found.samples.skipped} / {found.samples.seen_twice} "
              f"({found.samples.trained} trained)")
        print(f"difference: {abs(simulated - measured):.1f} pp "
              f"(the model {'below' if simulated < measured else 'above'} the measured run)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
