"""A tiny distributed training run, started by torchrun from the tests (tests/distributed)::

    torchrun --nproc-per-node=2 tests/distributed/dist_train.py RUN_DIR OUT_DIR [options]

TBPTT over an LSTM with dropout, hidden state carried across batches, a shuffled map-style
DataLoader (the engine inserts the DistributedSampler) and gradient accumulation over two
splits: every kind of per-rank state differs between ranks. Each worker writes, when its fit
ends, ``OUT_DIR/final-<rank>.pt`` (parameters, its RNG state, its carried hidden state) and its
pid as ``OUT_DIR/pid-<rank>-<restart>`` when it starts training, and the number of its
``validation_step`` calls as ``OUT_DIR/validation-calls-<rank>``. ``--val-epoch-slow SECONDS`` adds a
slow validation pass after each epoch (counted in ``OUT_DIR/validated-<rank>``), to signal a job
while it validates; ``REQUEUE_COMMAND`` becomes ``requeue_command``, as in docs/preemption.md's
train.py. Without torchrun it runs as one process (rank 0).

With ``--validate-every N`` each rank also validates (its block of the batches of a shuffled
validation set of ``--val-samples`` samples, with ``--val-workers`` DataLoader workers) every N
optimizer steps and at epoch ends; ``--val-slow`` sleeps in each validation batch, so that a
signal can land inside a pass. ``--log-values`` logs, in each training split, the loss with
``sync=True`` (``synced_loss``) and without (``own_loss``) and the batch's samples summed over the
ranks (``samples``), and in validation the samples (``val_samples``, summed) and the largest
target (``val_max``). ``--no-carry`` resets the hidden state at each batch (in validation too,
whose batches are then split across the ranks instead of all read by rank 0).

``--memory-tier DIR`` (``{node}`` in it: the node's GROUP_RANK), ``--peer-copies N`` and
``--durable-every N`` give the checkpoints a memory tier (CheckpointConfig.local_tier, peer_copies,
durable_every_n_splits, default 50).

``--start-timeout SECONDS`` sets ``TrainerConfig.start_timeout``. ``--interpreter-exit``: a finished
rank leaves through the interpreter's teardown (not ``rank_exit.leave``) and writes, from an
``atexit`` handler registered before ``fit``, whether a process group was still up then
(``OUT_DIR/group-at-exit-<rank>``).

``--mlflow URI EXPERIMENT`` and ``--wandb DIR PROJECT`` give every rank the tracker logger
(engine.loggers.MLflow to that server, engine.loggers.WandB offline under DIR); rank 0 sends.

``--poison`` makes one sample's input NaN (one rank meets it each epoch) and trains with
``engine.Rollback()``: both ranks roll back together.

Environment knobs: ``KILLS="RESTART/RANK/FAULTS;..."`` arms engine fault points (SPLITLOOP_FAULTS
syntax) on that rank in that try of the group (TORCHELASTIC_RESTART_COUNT), in its first process
only (``OUT_DIR/faults-armed-*`` says it was armed); ``DIVERGE_RANK`` +
``DIVERGE_AT`` (first try only) add a tiny offset to one parameter of that rank after that many
splits (a replica that drifted). ``VALIDATION_PAUSE="RANK/BATCH"`` (first try only): that rank
writes ``OUT_DIR/validating-<rank>`` in its BATCH-th validation batch and waits for ``OUT_DIR/go``
(so a test signals it while it validates, its validation DataLoader workers alive).
``HANG_BEFORE_FIT="RESTART/RANK"``: that rank of that try sleeps for ever before ``fit`` (a rank
stuck loading its data: it never arrives). ``SKIP_ALLREDUCE="RESTART/RANK/CALL"``: that rank of
that try skips the all-reduce of the CALL-th boundary agreement and takes its own flags (a rank
that skips a collective: it goes on to the checkpoint's collectives, where it waits for ever).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # tests/ folders must not shadow the real packages

import argparse
import atexit
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
        loss = torch.nn.functional.mse_loss(self.head(self.dropout(out)), y)
        if self.log_values:
            self.log("synced_loss", loss, sync=True)
            self.log("own_loss", loss)
            self.log("samples", x.shape[0], reduce="sum", sync=True)
        return loss, hidden

    def validation_step(self, batch: Any, hidden: Any = None) -> Any:
        self.validation_batches += 1
        if self.validation_batches == self.pause_at_validation_batch:
            pause_for_go(self.out)
        x, y = batch
        out, hidden = self.rnn(x, hidden)
        time.sleep(self.validation_sleep)
        if self.log_values:
            self.log("val_samples", x.shape[0], reduce="sum")
            self.log("val_max", y.max(), reduce="max")
        return torch.nn.functional.mse_loss(self.head(out), y), hidden

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.learning_rate)

    validation_sleep = 0.0
    log_values = False
    learning_rate = 0.02
    validation_batches = 0
    pause_at_validation_batch: int | None = None
    out = pathlib.Path()


def pause_for_go(out: pathlib.Path) -> None:
    (out / f"validating-{os.environ['RANK']}").write_text("")
    deadline = time.monotonic() + 120
    while not (out / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class PlateauModel(Model):
    """Logs its training loss (each rank its own: other data, other dropout) and the lr, and
    reduces the lr on a plateau of that loss every two splits (``--plateau-and-loggers``)."""

    def training_step(self, batch: Any, hidden: Any = None) -> Any:
        loss, hidden = super().training_step(batch, hidden)
        self.log("train_loss", loss)
        self.log("lr", self.optimizers().param_groups[0]["lr"], reduce="last")
        return loss, hidden

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.02)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.3)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss", "interval": "step", "frequency": 2}}


class SlowValidation(Model):
    """Validates after each epoch, slowly, counting its validation splits in a file the test
    watches (to signal the job while a validation pass runs). Its hidden state is not carried
    across batches."""

    def __init__(self, seconds: float, counter: pathlib.Path) -> None:
        super().__init__()
        self.seconds, self.counter, self.validated = seconds, counter, 0
        # No hidden state through the validation pass: its batches are split across the ranks,
        # so every rank validates (one batch each with 2 ranks).
        self.carry_hidden_across_batches = False

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


def skip_one_agreement(call: int) -> None:
    """This rank's ``call``-th boundary agreement returns its own flags without the all-reduce."""
    import engine.distributed
    from engine.distributed import agreement

    calls = [0]
    real = agreement.agree

    def agree(context, preempted, stop, checkpoint):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == call:
            return agreement.AgreedFlags(preempted, stop, checkpoint)
        return real(context, preempted, stop, checkpoint)

    engine.distributed.agree = agree  # what the run's coordinator calls


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    parser.add_argument("--writer", choices=("sync", "thread", "process"), default=None,
                        help="CheckpointConfig.writer (default: 'thread' with --async, else 'sync'; "
                             "SPLITLOOP_TEST_WRITER=process makes it 'process')")
    parser.add_argument("--accumulate", type=int, default=2, help="accumulate_grad (over splits)")
    parser.add_argument("--slow", type=float, default=0.0, help="sleep per split (seconds), to be killed or signalled")
    parser.add_argument("--validate-every", type=int, default=None, help="validate every N optimizer steps")
    parser.add_argument("--val-workers", type=int, default=0)
    parser.add_argument("--val-samples", type=int, default=SAMPLES // 3)
    parser.add_argument("--log-values", action="store_true", help="log values with and without sync (see above)")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--start-timeout", type=float, default=None, help="TrainerConfig.start_timeout (seconds)")
    parser.add_argument("--interpreter-exit", action="store_true",
                        help="a finished rank leaves through the interpreter's teardown (rank_exit.leave does not)")
    parser.add_argument("--no-carry", dest="carry", action="store_false",
                        help="the hidden state resets at each batch (carry_hidden_across_batches=False)")
    parser.add_argument("--val-slow", type=float, default=0.0, help="sleep per validation batch (seconds)")
    parser.add_argument("--stop-rank", type=int, default=None, help="this rank alone asks to stop ...")
    parser.add_argument("--stop-at", type=int, default=0, help="... after this many splits")
    parser.add_argument("--poison", action="store_true",
                        help="sample POISONED_SAMPLE's input is NaN from time step 5 on; train with engine.Rollback()")
    parser.add_argument("--no-epoch-checkpoint", dest="epoch_checkpoint", action="store_false",
                        help="no checkpoint at epoch ends (CheckpointConfig.at_epoch_end=False)")
    parser.add_argument("--plateau-and-loggers", action="store_true",
                        help="a ReduceLROnPlateau on each rank's own training loss; TensorBoard and CSV loggers "
                             "writing to OUT_DIR/tensorboard-<rank> and OUT_DIR/metrics-<rank>.csv")
    parser.add_argument("--mlflow", nargs=2, metavar=("URI", "EXPERIMENT"), help="engine.loggers.MLflow to that server")
    parser.add_argument("--wandb", nargs=2, metavar=("DIR", "PROJECT"), help="engine.loggers.WandB, offline, in DIR")
    parser.add_argument("--val-epoch-slow", type=float, default=None,
                        help="validate after each epoch, sleeping this long per validation split (counted)")
    parser.add_argument("--fail-after-preemption-rank", type=int, default=None,
                        help="this rank exits 3 after its preempted fit (first start only)")
    parser.add_argument("--watchdog", type=float, default=None,
                        help="the watchdog's min_timeout_s (test-sized: first_timeout_s 120, polled every 0.05 s)")
    parser.add_argument("--memory-tier", default=None,
                        help="CheckpointConfig.local_tier; '{node}' in it becomes this node's GROUP_RANK")
    parser.add_argument("--peer-copies", type=int, default=0, help="CheckpointConfig.peer_copies")
    parser.add_argument("--durable-every", type=int, default=None, help="CheckpointConfig.durable_every_n_splits")
    parser.add_argument("--on-io-error", default="raise", help="CheckpointConfig.on_io_error")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))  # a single process (no torchrun) is rank 0
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = pathlib.Path(args.out_dir)
    callbacks: list[engine.Callback] = []
    torch.manual_seed(100)  # the same initial parameters everywhere (DDP also broadcasts rank 0's)
    model = Model() if args.val_epoch_slow is None else SlowValidation(args.val_epoch_slow, out / f"validated-{rank}")
    if args.plateau_and_loggers:
        model = PlateauModel()
    torch.manual_seed(1000 + rank)  # dropout differs per rank
    for kill in filter(None, os.environ.get("KILLS", "").split(";")):
        kill_restart, kill_rank, faults = kill.split("/")
        if (int(kill_restart), int(kill_rank)) == (restart, rank) and first_process_of_the_try(out, rank, restart):
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
    model.log_values, model.learning_rate = args.log_values, args.lr
    if not args.carry:
        model.carry_hidden_across_batches = False
    pause_rank, _, pause_batch = os.environ.get("VALIDATION_PAUSE", "").partition("/")
    if restart == 0 and pause_rank == str(rank):
        model.pause_at_validation_batch = int(pause_batch)
    trackers: list[engine.loggers.Logger] = []  # every rank is given them; rank 0 alone opens them
    if args.mlflow:
        trackers.append(engine.loggers.MLflow(args.mlflow[0], experiment=args.mlflow[1], retry_seconds=0.2))
    if args.wandb:
        os.environ.pop("WANDB_SERVICE", None)  # its own wandb-core, not the test process's
        trackers.append(engine.loggers.WandB(project=args.wandb[1], mode="offline", dir=args.wandb[0],
                                             retry_seconds=0.2))
    tier = memory_tier(args)
    config = engine.TrainerConfig(
        max_epochs=args.epochs, run_dir=args.run_dir, progress_bar="off", accumulate_grad=args.accumulate, device="cpu",
        checkpoint=engine.CheckpointConfig(every_n_splits=args.every, keep_last=3, writer=checkpoint_writer(args, tier),
                                           at_epoch_end=args.epoch_checkpoint, on_io_error=args.on_io_error,
                                           **tier),
        val_every_n_steps=args.validate_every,
        val_at_epoch_end=args.validate_every is not None or args.val_epoch_slow is not None,
        requeue_command=os.environ.get("REQUEUE_COMMAND"),  # as docs/preemption.md's train.py
        loggers=([engine.loggers.TensorBoard(str(out / f"tensorboard-{rank}")),
                  engine.loggers.CSV(str(out / f"metrics-{rank}.csv"))] if args.plateau_and_loggers else []) + trackers,
        anomaly=engine.Rollback() if args.poison else None,
        **({} if args.start_timeout is None else {"start_timeout": args.start_timeout}),
        **({} if args.watchdog is None else {"watchdog": engine.Watchdog(
            min_timeout_s=args.watchdog, first_timeout_s=120.0, warmup=3, poll_s=0.05)}),
    )
    (out / f"pid-{rank}-{restart}").write_text(str(os.getpid()))
    if os.environ.get("HANG_BEFORE_FIT") == f"{restart}/{rank}":
        time.sleep(3600)
    skip_try, _, skip_call = os.environ.get("SKIP_ALLREDUCE", "").rpartition("/")
    if skip_try == f"{restart}/{rank}":
        skip_one_agreement(int(skip_call))
    if args.validate_every is not None:
        val_data = validation_loader(args.val_samples, args.val_workers)
    else:
        val_data = None if args.val_epoch_slow is None else DataLoader(TensorDataset(x[:4], y[:4]), batch_size=BATCH)
    if args.interpreter_exit:
        atexit.register(record_group_at_exit, out / f"group-at-exit-{rank}")  # runs after the engine's (LIFO)
    try:
        result = engine.Trainer(config, callbacks).fit(model, loader, val_data)
    except SystemExit:
        if restart == 0 and args.fail_after_preemption_rank == rank:
            os._exit(3)  # a worker failing after the preemption commit: torchrun restarts the group
        raise
    final = {f"param.{key}": value.detach().clone() for key, value in model.state_dict().items()}
    final["rng"] = torch.get_rng_state()
    if model.last_hidden is not None:  # None when this process trained nothing (a finished run)
        final["hidden.h"], final["hidden.c"] = (t.detach().clone() for t in model.last_hidden)
    torch.save(final, out / f"final-{rank}.pt")
    (out / f"validation-calls-{rank}").write_text(str(model.validation_batches))  # this process's calls
    print(f"rank {rank} done: {result.stop_reason} steps={result.optimizer_steps}", flush=True)
    if args.interpreter_exit:
        sys.exit(0)
    return 0


# Set (tests/distributed/test_kill_tests_with_a_memory_tier.py, tests/writer_switch.py): every
# job's checkpoints are written by writer processes.
WRITER_SWITCH = "SPLITLOOP_TEST_WRITER"


def checkpoint_writer(args: argparse.Namespace, tier: dict[str, Any]) -> str:
    """The writer of ``--writer``, else of the switch (where the engine takes a writer process:
    not with a memory tier in a process alone), else 'thread' with ``--async``, else 'sync'."""
    if args.writer is not None:
        return args.writer
    if os.environ.get(WRITER_SWITCH) == "process" and (int(os.environ.get("WORLD_SIZE", "1")) > 1 or not tier):
        return "process"
    return "thread" if args.asynchronous else "sync"


# Set (tests/distributed/test_kill_tests_with_a_memory_tier.py): every job without --memory-tier
# gets one under /dev/shm named after its run dir, with peer copies when it spans two nodes.
MEMORY_TIER_SWITCH = "SPLITLOOP_TEST_MEMORY_TIER"
SWITCHED_TIERS = "/dev/shm/splitloop-test-switched-"


def memory_tier(args: argparse.Namespace) -> dict[str, Any]:
    """The memory tier's settings of ``--memory-tier``, ``--peer-copies``, ``--durable-every``."""
    if args.memory_tier is None and os.environ.get(MEMORY_TIER_SWITCH):
        import hashlib
        args.memory_tier = SWITCHED_TIERS + hashlib.sha256(os.path.realpath(args.run_dir).encode()).hexdigest()[:16] + "-{node}"
        several_nodes = os.environ.get("LOCAL_WORLD_SIZE", "1") != os.environ.get("WORLD_SIZE", "1")
        args.peer_copies = 1 if several_nodes else args.peer_copies
    if args.memory_tier is None:
        return {}
    return {"local_tier": args.memory_tier.replace("{node}", os.environ.get("GROUP_RANK", "0")),
            "peer_copies": args.peer_copies, "durable_every_n_splits": args.durable_every or 50}


def first_process_of_the_try(out: pathlib.Path, rank: int, restart: int) -> bool:
    """Whether no process of ``rank`` started before this one in try ``restart`` of this job (its
    torchrun run id). On several nodes an agent whose own workers did not fail restarts them when
    another node's worker failed, without counting a restart (its TORCHELASTIC_RESTART_COUNT
    stays): KILLS armed for that try would fire again in the new process (a peer stopped for good)."""
    marker = out / f"faults-armed-{os.environ.get('TORCHELASTIC_RUN_ID', 'alone')}-{restart}-{rank}"
    try:
        marker.touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


def record_group_at_exit(path: pathlib.Path) -> None:
    """Whether a process group is still up when the interpreter's teardown begins."""
    path.write_text(str(torch.distributed.is_initialized()))


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
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, after the real packages
    from rank_exit import leave

    leave(main())
