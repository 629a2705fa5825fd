"""Cost of checkpointing every split in a distributed run: 2 ranks (gloo, CPU) under torchrun.

Two torchrun jobs train the same small TBPTT LSTM (hidden state carried, shuffled shards,
dropout) for the same number of splits; one checkpoints at every split (the commit across ranks:
each rank writes its part, digests compared, rank 0 commits), the other only once at the end.
Each job's rank 0 times its ``fit`` (after the process group is up and torch is imported), and
the jobs alternate over ``--repeats`` rounds; medians are reported.

Reproduce (from the repository root)::

    python benchmarks/distributed_overhead.py              # about 1-2 minutes on 2 shared cores
    python benchmarks/distributed_overhead.py --repeats 1  # quicker, noisier

The last line is ``distributed every-split overhead ratio: X.XXX (...)`` (time with a checkpoint
every split / time without; 1.000 would be free).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPOSITORY = pathlib.Path(__file__).resolve().parents[1]


def worker(run_dir: str, every: int, report: str) -> None:
    """One rank of a job (started by torchrun)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import engine

    class Model(engine.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tbptt_split_length = 8
            self.carry_hidden_across_batches = True
            self.rnn = torch.nn.LSTM(16, 64, batch_first=True)
            self.dropout = torch.nn.Dropout(0.1)
            self.head = torch.nn.Linear(64, 16)

        def training_step(self, batch, hidden=None):
            x, y = batch
            out, hidden = self.rnn(x, hidden)
            return torch.nn.functional.mse_loss(self.head(self.dropout(out)), y), hidden

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    model = Model()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, 16, generator=generator)
    loader = DataLoader(TensorDataset(x, x.roll(1, dims=1)), batch_size=8, shuffle=True)
    policy = engine.CheckpointConfig(every_n_splits=every, at_epoch_end=False, keep_last=2)
    config = engine.TrainerConfig(max_epochs=2, run_dir=run_dir, checkpoint=policy, progress_bar="off", device="cpu")
    started = time.perf_counter()
    engine.Trainer(config).fit(model, loader, resume="off")
    if os.environ["RANK"] == "0":
        pathlib.Path(report).write_text(str(time.perf_counter() - started))


def job(directory: pathlib.Path, name: str, every: int) -> float:
    report = directory / f"{name}.seconds"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
               "--worker", str(directory / name), str(every), str(report)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPOSITORY}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return float(report.read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    every_split, none = [], []
    with tempfile.TemporaryDirectory(dir=".") as temporary:
        directory = pathlib.Path(temporary)
        for round_index in range(args.repeats):
            order = [("every", 1), ("none", 10 ** 9)] if round_index % 2 == 0 else [("none", 10 ** 9), ("every", 1)]
            for name, every in order:
                seconds = job(directory, f"{name}-{round_index}", every)
                (every_split if name == "every" else none).append(seconds)
                print(f"round {round_index}: checkpoint {name:5s} {seconds:.3f} s", flush=True)
    with_checkpoints, without = statistics.median(every_split), statistics.median(none)
    print(f"distributed every-split overhead ratio: {with_checkpoints / without:.3f} "
          f"(2 ranks, gloo on CPU, 64 splits per rank: {with_checkpoints:.2f} s with a checkpoint every split, "
          f"{without:.2f} s with one at the end; median of {args.repeats})")


if __name__ == "__main__":
    main()
