"""A tiny distributed training run, started by torchrun from the tests (tests/distributed)::

    torchrun --nproc-per-node=2 tests/distributed/dist_train.py RUN_DIR OUT_DIR [options]

TBPTT over an LSTM with dropout, hidden state carried across batches, a shuffled map-style
DataLoader (the engine inserts the DistributedSampler) and gradient accumulation over two
splits: every kind of per-rank state differs between ranks. Each worker writes, when its fit
ends, ``OUT_DIR/final-<rank>.pt`` (parameters, its RNG state, its carried hidden state) and its
pid as ``OUT_DIR/pid-<rank>-<restart>`` when it starts training. ``--val-epoch-slow SECONDS`` adds a
slow validation pass after each epoch (counted in ``OUT_DIR/validated-<rank>``), to signal a job
while it validates; ``REQUEUE_COMMAND`` becomes ``requeue_command``, as in docs/preemption.md's
train.py. Without torchrun it runs as one process (rank 0).

With ``--validate-every N`` each rank also validates (on the whole validation set, shuffled, with
``--val-workers`` DataLoader workers) every N optimizer steps and at epoch ends; ``--val-slow``
sleeps in each validation batch, so that a signal can land inside a pass.

``--poison`` makes one sample's input NaN (one rank meets it each epoch) and trains with
``engine.Rollback()``: both ranks roll back together.

Environment knobs: ``KILLS="RESTART/RANK/FAULTS;..."`` arms engine fault points (SPLITLOOP_FAULTS
syntax) on that rank in that try of the group (TORCHELASTIC_RESTART_COUNT); ``DIVERGE_RANK`` +
``DIVERGE_AT`` (first try only) add a tiny offset to one parameter of that rank after that many
splits (a replica that drifted). ``VALIDATION_PAUSE="RANK/BATCH"`` (first try only): that rank
writes ``OUT_DIR/validating-<rank>`` in its BATCH-th validation batch and waits for ``OUT_DIR/go``
(so a test signals it while it validates, its validation DataLoader workers alive).
"""

from __future__ import annotations

import os
import sys

if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # tests/ folders must not shadow the real packages

import argparse
import pathlib
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import engine

SAMPLES, BATCH, TIME, FEATURES, SPLIT = 24, 2, 12, 3, 4
POISONED_SAMPLE = 9


class Model(engine.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tbptt_split_length = SPLIT
        self.carry_hidden_across_batches = True
        self.rnn = torch.nn.LSTM(FEATURES, 6, batch_first=True)
        self.dropout = torch.nn.Dropout(0.3)
        self.head = torch.nn.Linear(6, 1)
        self.last_hidden: Any = None

    def training_step(self, batch: Any, hidden: Any = None) -> Any:
        x, y = batch
        out, hidden = self.rnn(x, hidden)
        self.last_hidden = hidden
        return torch.nn.functional.mse_loss(self.head(self.dropout(out)), y), hidden

    def validation_step(self, batch: Any, hidden: Any = None) -> Any:
        self.validation_batches += 1
        if self.validation_batches == self.pause_at_validation_batch:
            pause_for_go(self.out)
        x, y = batch
        out, hidden = self.rnn(x, hidden)
        time.sleep(self.validation_sleep)
        return torch.nn.functional.mse_loss(self.head(out), y), hidden

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.02)

    validation_sleep = 0.0
    validation_batches = 0
    pause_at_validation_batch: int | None = None
    out = pathlib.Path()


def pause_for_go(out: pathlib.Path) -> None:
    (out / f"validating-{os.environ['RANK']}").write_text("")
    deadline = time.monotonic() + 120
    while not (out / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class SlowValidation(Model):
    """Validates after each epoch, slowly, counting its validation splits in a file the test
    watches (to signal the job while a validation pass runs)."""

    def __init__(self, seconds: float, counter: pathlib.Path) -> None:
        super().__init__()
        self.seconds, self.counter, self.validated = seconds, counter, 0

    def validation_step(self, batch: Any, hidden: Any = None) -> Any:
        import time
        x, y = batch
        out, hidden = self.rnn(x, hidden)
        self.validated += 1
        self.counter.write_text(str(self.validated))
        time.sleep(self.seconds)
        return torch.nn.functional.mse_loss(self.head(out), y), hidden


class Diverge(engine.Callback):
    """Makes this rank's replica drift: the next checkpoint must refuse to commit."""

    def __init__(self, model: Model, at: int) -> None:
        self.model, self.at, self.seen = model, at, 0

    def on_split_end(self, view: engine.RunView) -> None:
        self.seen += 1
        if self.seen == self.at:
            with torch.no_grad():
                self.model.head.bias.add_(1e-3)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    parser.add_argument("--accumulate", type=int, default=2, help="accumulate_grad (over splits)")
    parser.add_argument("--slow", type=float, default=0.0, help="sleep per split (seconds), to be killed or signalled")
    parser.add_argument("--validate-every", type=int, default=None, help="validate every N optimizer steps")
    parser.add_argument("--val-workers", type=int, default=0)
    parser.add_argument("--val-slow", type=float, default=0.0, help="sleep per validation batch (seconds)")
    parser.add_argument("--stop-rank", type=int, default=None, help="this rank alone asks to stop ...")
    parser.add_argument("--stop-at", type=int, default=0, help="... after this many splits")
    parser.add_argument("--poison", action="store_true",
                        help="sample POISONED_SAMPLE's input is NaN from time step 5 on; train with engine.Rollback()")
    parser.add_argument("--no-epoch-checkpoint", dest="epoch_checkpoint", action="store_false",
                        help="no checkpoint at epoch ends (CheckpointConfig.at_epoch_end=False)")
    parser.add_argument("--val-epoch-slow", type=float, default=None,
                        help="validate after each epoch, sleeping this long per validation split (counted)")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))  # a single process (no torchrun) is rank 0
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = pathlib.Path(args.out_dir)
    callbacks: list[engine.Callback] = []
    torch.manual_seed(100)  # the same initial parameters everywhere (DDP also broadcasts rank 0's)
    model = Model() if args.val_epoch_slow is None else SlowValidation(args.val_epoch_slow, out / f"validated-{rank}")
    torch.manual_seed(1000 + rank)  # dropout differs per rank
    for kill in filter(None, os.environ.get("KILLS", "").split(";")):
        kill_restart, kill_rank, faults = kill.split("/")
        if (int(kill_restart), int(kill_rank)) == (restart, rank):
            os.environ["SPLITLOOP_FAULTS"] = faults
    if restart == 0 and os.environ.get("DIVERGE_RANK") == str(rank):
        callbacks.append(Diverge(model, int(os.environ["DIVERGE_AT"])))
    if args.slow:
        callbacks.append(Sleep(args.slow, out / f"splits-{rank}"))
    if args.stop_rank == rank:
        callbacks.append(StopAt(args.stop_at))
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, TIME, FEATURES, generator=generator)
    y = x.cumsum(dim=1)[..., :1] * 0.1
    if args.poison:
        x[POISONED_SAMPLE, 5:] = float("nan")  # computed from x before: y stays finite
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    model.validation_sleep, model.out = args.val_slow, out
    pause_rank, _, pause_batch = os.environ.get("VALIDATION_PAUSE", "").partition("/")
    if restart == 0 and pause_rank == str(rank):
        model.pause_at_validation_batch = int(pause_batch)
    config = engine.TrainerConfig(
        max_epochs=args.epochs, run_dir=args.run_dir, progress_bar="off", accumulate_grad=args.accumulate, device="cpu",
        checkpoint=engine.CheckpointConfig(every_n_splits=args.every, keep_last=3, asynchronous=args.asynchronous,
                                           at_epoch_end=args.epoch_checkpoint),
        val_every_n_steps=args.validate_every,
        val_at_epoch_end=args.validate_every is not None or args.val_epoch_slow is not None,
        requeue_command=os.environ.get("REQUEUE_COMMAND"),  # as docs/preemption.md's train.py
        anomaly=engine.Rollback() if args.poison else None,
    )
    (out / f"pid-{rank}-{restart}").write_text(str(os.getpid()))
    if args.validate_every is not None:
        val_data = validation_loader(x.shape[0] // 3, args.val_workers)
    else:
        val_data = None if args.val_epoch_slow is None else DataLoader(TensorDataset(x[:4], y[:4]), batch_size=BATCH)
    result = engine.Trainer(config, callbacks).fit(model, loader, val_data)
    final = {f"param.{key}": value.detach().clone() for key, value in model.state_dict().items()}
    final["rng"] = torch.get_rng_state()
    if model.last_hidden is not None:  # None when this process trained nothing (a finished run)
        final["hidden.h"], final["hidden.c"] = (t.detach().clone() for t in model.last_hidden)
    torch.save(final, out / f"final-{rank}.pt")
    print(f"rank {rank} done: {result.stop_reason} steps={result.optimizer_steps}", flush=True)
    return 0


def validation_loader(samples: int, workers: int) -> DataLoader:
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(samples, TIME, FEATURES, generator=generator)
    return DataLoader(TensorDataset(x, x.cumsum(dim=1)[..., :1] * 0.1), batch_size=BATCH, shuffle=True,
                      num_workers=workers)


class StopAt(engine.Callback):
    """Asks the run to stop after ``at`` splits of this process (a stop only this rank decides)."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, 0

    def on_split_end(self, view: engine.RunView) -> None:
        self.seen += 1
        if self.seen == self.at:
            view.request_stop(f"rank-local stop after {self.at} splits")


class Sleep(engine.Callback):
    """Slows training down and counts this process's splits in a file the test watches."""

    def __init__(self, seconds: float, counter: pathlib.Path) -> None:
        self.seconds, self.counter, self.splits = seconds, counter, 0

    def on_split_end(self, view: engine.RunView) -> None:
        import time
        self.splits += 1
        self.counter.write_text(str(self.splits))
        time.sleep(self.seconds)


if __name__ == "__main__":
    sys.exit(main())
