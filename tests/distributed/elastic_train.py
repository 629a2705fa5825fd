"""A tiny data-parallel run for the world-size-change tests (tests/distributed/test_elastic.py)::

    torchrun --nproc-per-node=W tests/distributed/elastic_train.py RUN_DIR OUT_DIR ATTEMPT [options]

A small MLP without dropout on a shuffled map-style DataLoader of ``SAMPLES`` samples, each
carrying its id; the per-rank batch is ``--batch`` (the engine inserts its sampler; a resumed run
keeps the checkpoint's global batch whatever ``--batch`` says). Each rank appends one line per
optimizer step to ``OUT_DIR/steps-<ATTEMPT>-<rank>.jsonl``: the step number (1-based, over the
whole run) and the ids of the samples it trained on in that step. ``--kill-at-step N``: rank 0
SIGKILLs itself once step N is done, before that boundary's checkpoint (so it is redone). The
final parameters go to ``OUT_DIR/final-<ATTEMPT>.pt`` (rank 0).
``--pause-at-step N`` (for ``torchrun --nnodes=MIN:MAX``): on 2 ranks only, rank 0 writes
``OUT_DIR/paused`` after step N and waits for ``OUT_DIR/go`` (the test starts a second agent
meanwhile). ``ATTEMPT`` ``w`` names the step files by the world size instead (one torchrun whose
group changes size).

``--tbptt``: a small RNN trained with TBPTT on sequences of ``TIME`` steps cut into splits of
``SPLIT`` (so several optimizer steps per batch, each split one step; a checkpoint after every
split, most of them inside a batch). ``--elastic``: ``TrainerConfig(elastic=True)`` (a single
process that orders its data the global way). ``--workers N``: the DataLoader loads in ``N``
worker processes and each sample draws a noise value there (augmentation, added to its input);
the step files then hold each sample's ``noise`` too, in the order of ``ids``.
``--no-distributed-sampler``:
``TrainerConfig(distributed_sampler=False)``. ``--resume NAME``: ``fit(resume=NAME)``. Without
torchrun the script runs as one plain process.

A refused resume writes its error to ``OUT_DIR/error-<ATTEMPT>-<rank>.txt`` and exits 2.
"""

from __future__ import annotations

import os
import sys

if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # tests/ folders must not shadow the real packages

import argparse
import json
import pathlib
import signal
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import engine

SAMPLES, FEATURES = 48, 3
TIME, SPLIT = 6, 2


class Model(engine.Module):
    def __init__(self, record: "Record") -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.record = record

    def training_step(self, batch: Any) -> Any:
        x, y, ids = batch[:3]
        self.record.ids = [int(i) for i in ids]
        if len(batch) == 4:  # --workers: the noise each sample drew in its worker
            self.record.noise = [float(value) for value in batch[3]]
        return torch.nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Record(engine.Callback):
    """Writes each step's sample ids; rank 0 SIGKILLs itself after ``kill_at`` steps."""

    def __init__(self, path: pathlib.Path, kill_at: int | None, rank: int, pause_at: int | None = None) -> None:
        self.path, self.kill_at, self.rank, self.pause_at = path, kill_at, rank, pause_at
        self.ids: list[int] = []
        self.noise: list[float] | None = None

    def on_split_end(self, view: engine.RunView) -> None:
        with self.path.open("a") as file:
            row: dict[str, Any] = {"step": view.optimizer_steps, "ids": self.ids}
            if self.noise is not None:
                row["noise"] = self.noise
            file.write(json.dumps(row) + "\n")
        if self.rank == 0 and view.optimizer_steps == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.rank == 0 and view.optimizer_steps == self.pause_at:
            (self.path.parent / "paused").write_text("")
            deadline = time.monotonic() + 200
            while not (self.path.parent / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)


class SequenceModel(engine.Module):
    """A one-layer RNN trained with TBPTT; each sample's id runs along its time steps."""

    tbptt_split_length = SPLIT

    def __init__(self, record: "Record") -> None:
        super().__init__()
        self.rnn = torch.nn.RNN(FEATURES, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 1)
        self.record = record

    def training_step(self, batch: Any, hidden: Any = None) -> Any:
        x, y, ids = batch
        self.record.ids = [int(i) for i in ids[:, 0]]
        out, hidden = self.rnn(x, hidden)
        return torch.nn.functional.mse_loss(self.head(out), y), hidden

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class NoisyDataset(Dataset):
    """Each sample's input plus noise drawn when it is loaded (in a worker process), and the noise."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        noise = torch.rand(())
        return self.x[index] + noise, self.y[index], torch.tensor(index), noise


def loader(batch: int, tbptt: bool = False, workers: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(7)
    if tbptt:
        x = torch.randn(SAMPLES, TIME, FEATURES, generator=generator)
        ids = torch.arange(SAMPLES).unsqueeze(1).expand(SAMPLES, TIME).contiguous()
        return DataLoader(TensorDataset(x, x.sum(dim=2, keepdim=True).sin(), ids), batch_size=batch, shuffle=True)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    if workers:
        return DataLoader(NoisyDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=batch, shuffle=True,
                          num_workers=workers)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin(), torch.arange(SAMPLES)), batch_size=batch,
                      shuffle=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("out_dir")
    parser.add_argument("attempt")
    parser.add_argument("--batch", type=int, default=4, help="per-rank batch size in the script")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--kill-at-step", type=int, default=None)
    parser.add_argument("--pause-at-step", type=int, default=None)
    parser.add_argument("--tbptt", action="store_true")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--elastic", action="store_true")
    parser.add_argument("--no-distributed-sampler", action="store_true")
    parser.add_argument("--resume", default="auto")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    out = pathlib.Path(args.out_dir)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    attempt = str(world_size) if args.attempt == "w" else args.attempt
    record = Record(out / f"steps-{attempt}-{rank}.jsonl", args.kill_at_step, rank,
                    args.pause_at_step if world_size == 2 else None)
    torch.manual_seed(100)
    model = SequenceModel(record) if args.tbptt else Model(record)
    torch.manual_seed(1000 + rank)
    config = engine.TrainerConfig(max_epochs=args.epochs, run_dir=args.run_dir, progress_bar="off", device="cpu",
                                  checkpoint=engine.CheckpointConfig(every_n_splits=1, keep_last=2),
                                  elastic=args.elastic, distributed_sampler=not args.no_distributed_sampler)
    try:
        engine.Trainer(config, [record]).fit(model, loader(args.batch, args.tbptt, args.workers), resume=args.resume)
    except engine.CheckpointIncompatible as error:
        (out / f"error-{attempt}-{rank}.txt").write_text(f"{type(error).__name__}: {error}")
        return 2
    if rank == 0:
        torch.save({key: value.detach().clone() for key, value in model.state_dict().items()},
                   out / f"final-{attempt}.pt")
    return 0


if __name__ == "__main__":
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, after the real packages
    from rank_exit import leave

    leave(main())
