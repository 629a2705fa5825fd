"""Small training scenarios shared by the parity, counter and kill tests.

Each scenario is a tiny model on synthetic sequences (12 samples, batch 4 -> 3 batches per
epoch; 16 time steps, TBPTT split 4 -> 4 splits per batch), shuffled by a plain
``DataLoader(shuffle=True)`` (global RNG) and with dropout, so that exact resume has to get the
data order and every RNG stream right.

Run as a script to train one scenario into a run directory (used by the subprocess kill tests)::

    python tests/scenarios.py NAME RUN_DIR [--epochs N] [--async]

``objectdir:///abs/path`` run directories are a local directory seen through a filesystem
without atomic rename or file locks: the object-store code paths (manifest as the commit point,
heartbeat lease), shared between real processes.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and sys.path and sys.path[0] == __import__("os").path.dirname(__file__):
    # Run as a script, tests/ is first on sys.path and its tests/progress/ folder (no
    # __init__.py) would shadow the real ``progress`` package as a namespace package: last.
    sys.path.append(sys.path.pop(0))

import argparse
import contextlib
import dataclasses
import os
import random
import signal
import sys
import time
from typing import Any, Callable

import fsspec
import torch
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from torch.utils.data import DataLoader, TensorDataset

import engine
from writer_switch import trainer_config

SAMPLES, BATCH, TIME, FEATURES, SPLIT = 12, 4, 16, 3, 4
SEED = 1234


class ObjectDirectory(DirFileSystem):
    """``objectdir:///abs/path``: a local directory as an object store would look to the
    engine (not a LocalFileSystem: no atomic rename, no flock), visible to every process."""

    protocol = "objectdir"

    def __init__(self, **options: Any) -> None:
        super().__init__(path="/", fs=LocalFileSystem(), **options)

    @classmethod
    def _strip_protocol(cls, path: str) -> str:  # type: ignore[override]
        return path[len("objectdir://"):] if path.startswith("objectdir://") else path


fsspec.register_implementation("objectdir", ObjectDirectory, clobber=True)


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, TIME, FEATURES, generator=generator)
    y = x.cumsum(dim=1)[..., :1] * 0.1 + torch.randn(SAMPLES, TIME, 1, generator=generator) * 0.01
    return TensorDataset(x, y)


def make_loader(shuffle: bool = True) -> DataLoader:
    return DataLoader(make_dataset(), batch_size=BATCH, shuffle=shuffle)


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    tbptt: bool = True
    carry: bool = False
    optimizers: int = 1
    manual: bool = False
    accumulate: int = 1
    accumulate_over: str = "splits"
    clip: float | None = None
    step_scheduler: bool = False
    epoch_scheduler: bool = False
    shuffle: bool = True
    precision: str = "32"

    def config_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"accumulate_grad": self.accumulate, "accumulate_over": self.accumulate_over,
                                  "precision": self.precision}
        if self.clip is not None:
            kwargs["gradient_clip_val"] = self.clip
        return kwargs


SCENARIOS = {s.name: s for s in [
    Scenario("tbptt", clip=0.5, step_scheduler=True),
    Scenario("plain", tbptt=False, epoch_scheduler=True),
    Scenario("several_optimizers", tbptt=False, optimizers=2),
    Scenario("tbptt_several_optimizers", optimizers=2, clip=1.0),
    Scenario("manual", manual=True),
    Scenario("accumulate_splits", accumulate=5, accumulate_over="splits"),
    Scenario("accumulate_batches", accumulate=2, accumulate_over="batches", epoch_scheduler=True),
    Scenario("carried_hidden", carry=True),
    Scenario("bf16", precision="bf16-mixed", clip=0.5, step_scheduler=True),
    Scenario("fp16_accumulate", precision="16-mixed", accumulate=3, clip=0.5, step_scheduler=True),
]}


def scenario_params() -> list[Any]:
    """Every scenario name for ``pytest.mark.parametrize``; those that run the LSTM in bfloat16
    on the CPU are marked ``cpu_bf16_lstm`` (skipped on CPUs without one, tests/cpu_features.py)."""
    import pytest

    return [pytest.param(name, marks=pytest.mark.cpu_bf16_lstm) if SCENARIOS[name].precision == "bf16-mixed"
            else name for name in sorted(SCENARIOS)]


class SeqModel(engine.Module):
    """LSTM -> dropout -> linear head; with two optimizers a second head trains on detached features."""

    def __init__(self, scenario: Scenario) -> None:
        super().__init__()
        self.scenario = scenario
        self.tbptt_split_length = SPLIT if scenario.tbptt else None
        self.carry_hidden_across_batches = scenario.carry
        self.automatic_optimization = not scenario.manual
        self.rnn = torch.nn.LSTM(FEATURES, 8, batch_first=True)
        self.dropout = torch.nn.Dropout(0.2)
        self.head = torch.nn.Linear(8, 1)
        self.aux = torch.nn.Linear(8, 1)

    def forward_loss(self, batch: Any, hidden: Any, optimizer_index: int) -> tuple[torch.Tensor, Any]:
        x, y = batch
        with self.recurrent_precision():
            out, hidden = self.rnn(x, hidden)
        if optimizer_index == 0:
            loss = torch.nn.functional.mse_loss(self.head(self.dropout(out)), y)
        else:
            loss = torch.nn.functional.mse_loss(self.aux(self.dropout(out.detach())), y)
        return loss, hidden

    def recurrent_precision(self) -> Any:
        """oneDNN has no float16 LSTM on the CPU: under "16-mixed" the LSTM runs in float32."""
        if self.scenario.precision == "16-mixed":
            return torch.autocast("cpu", enabled=False)
        return contextlib.nullcontext()

    def training_step(self, batch: Any, hidden: Any = None, optimizer_index: int = 0) -> Any:
        if self.scenario.manual:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            loss, hidden = self.forward_loss(batch, hidden, 0)
            loss.backward()
            optimizer.step()
        else:
            loss, hidden = self.forward_loss(batch, hidden, optimizer_index)
        return (loss, hidden) if self.scenario.tbptt else loss

    def configure_optimizers(self) -> Any:
        return make_optimizers(self, self.scenario)


def make_optimizers(model: SeqModel, scenario: Scenario) -> dict[str, Any]:
    main_parameters = [*model.rnn.parameters(), *model.head.parameters()]
    optimizers = [torch.optim.Adam(main_parameters, lr=0.01)]
    if scenario.optimizers == 2:
        optimizers.append(torch.optim.SGD(model.aux.parameters(), lr=0.05, momentum=0.9))
    schedules = []
    if scenario.step_scheduler:
        schedules.append(engine.LRSchedule(torch.optim.lr_scheduler.StepLR(optimizers[0], 3, 0.7), "step"))
    if scenario.epoch_scheduler:
        schedules.append(engine.LRSchedule(torch.optim.lr_scheduler.ExponentialLR(optimizers[0], 0.5), "epoch"))
    return {"optimizers": optimizers, "schedulers": schedules}


class LossRecorder(engine.Callback):
    """Records every split's losses (floats are exact copies of the float32 values)."""

    def __init__(self) -> None:
        self.losses: list[list[float]] = []
        self.cursors: list[tuple[int, int, int, int]] = []

    def on_split_end(self, view: engine.RunView) -> None:
        self.losses.append(view.losses)
        self.cursors.append(view.cursor.as_tuple())


def build(name: str, seed: int | None = None) -> tuple[SeqModel, DataLoader]:
    scenario = SCENARIOS[name]
    seed_all(SEED if seed is None else seed)
    model = SeqModel(scenario)
    return model, make_loader(scenario.shuffle)


def run_engine(name: str, epochs: int = 2, **config: Any) -> tuple[SeqModel, list[list[float]], engine.FitResult]:
    model, loader = build(name)
    recorder = LossRecorder()
    settings = dict(max_epochs=epochs, run_dir=None, checkpoint=None, progress_bar="off")
    settings.update(SCENARIOS[name].config_kwargs())
    settings.update(config)
    result = engine.Trainer(engine.TrainerConfig(**settings), callbacks=[recorder]).fit(model, loader)
    return model, recorder.losses, result


def run_by_hand(name: str, epochs: int = 2) -> tuple[SeqModel, list[list[float]]]:
    """The same training as a plain PyTorch loop, written out by hand."""
    scenario = SCENARIOS[name]
    model, loader = build(name)
    setup = make_optimizers(model, scenario)
    optimizers = setup["optimizers"]
    step_schedulers = [s.scheduler for s in setup["schedulers"] if s.interval == "step"]
    epoch_schedulers = [s.scheduler for s in setup["schedulers"] if s.interval == "epoch"]
    model._engine_optimizers = optimizers  # what self.optimizers() returns in manual mode
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(scenario.precision)
    autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype is not None else contextlib.nullcontext
    scaler = torch.amp.GradScaler("cpu", enabled=scenario.precision == "16-mixed")
    losses: list[list[float]] = []
    n = scenario.accumulate
    for _ in range(epochs):
        hidden = None
        units = 0
        pending = False
        for batch in loader:
            if not scenario.carry:
                hidden = None
            splits = [tuple(t[:, i:i + SPLIT] for t in batch) for i in range(0, TIME, SPLIT)] if scenario.tbptt else [batch]
            for index, split in enumerate(splits):
                if units == 0 and not pending and not scenario.manual:
                    for optimizer in optimizers:
                        optimizer.zero_grad()
                split_losses = []
                new_hidden = None
                for k, optimizer in enumerate(optimizers if not scenario.manual else optimizers[:1]):
                    if scenario.manual:
                        output = model.training_step(split, hidden) if scenario.tbptt else model.training_step(split)
                        loss, new_hidden = output if scenario.tbptt else (output, None)
                    else:
                        with autocast():
                            loss, new_hidden = model.forward_loss(split, hidden, k)
                        scaler.scale(loss / n if n > 1 else loss).backward()
                        pending = True
                    split_losses.append(loss.item())
                    unit_ends = scenario.accumulate_over == "splits" or index == len(splits) - 1
                    if not scenario.manual and unit_ends and units + 1 >= n:
                        step(optimizer, scenario, step_schedulers if k == 0 else [], scaler)
                        optimizer.zero_grad()
                        if k == len(optimizers) - 1:
                            scaler.update()
                if not scenario.manual:
                    unit_ends = scenario.accumulate_over == "splits" or index == len(splits) - 1
                    if unit_ends:
                        units = 0 if units + 1 >= n else units + 1
                        pending = units != 0
                if new_hidden is not None:
                    hidden = tuple(h.detach() for h in new_hidden)
                losses.append(split_losses)
        if pending:
            for k, optimizer in enumerate(optimizers):
                step(optimizer, scenario, step_schedulers if k == 0 else [], scaler)
                optimizer.zero_grad()
            scaler.update()
        for scheduler in epoch_schedulers:
            scheduler.step()
    return model, losses


def step(optimizer: torch.optim.Optimizer, scenario: Scenario, schedulers: list[Any],
         scaler: torch.amp.GradScaler) -> None:
    """Clip, step, then the step-interval schedulers unless the scaler skipped the step."""
    if scenario.clip is not None:
        if scaler.is_enabled():
            scaler.unscale_(optimizer)
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(parameters, scenario.clip)
    finite = not scaler.is_enabled() or all(
        bool(torch.isfinite(p.grad).all()) for group in optimizer.param_groups for p in group["params"]
        if p.grad is not None)
    scaler.step(optimizer)
    if finite:
        for scheduler in schedulers:
            scheduler.step()


class AnnounceStart(engine.Callback):
    """Prints 'training' when fit starts, so a test can kill the process at a random instant
    of training rather than of the imports."""

    def on_fit_start(self, view: engine.RunView) -> None:
        print("training", flush=True)


class SlowDown(engine.Callback):
    """Sleeps after every split (changes no number), to keep a process alive for a while."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_split_end(self, view: engine.RunView) -> None:
        time.sleep(self.seconds)


class HoldWhile(engine.Callback):
    """From the second split on, waits after each split while ``path`` exists (changes no
    number): a test keeps the process alive, with the first split's checkpoint committed, as
    long as it needs it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.splits = 0

    def on_split_end(self, view: engine.RunView) -> None:
        self.splits += 1
        while self.splits > 1 and os.path.exists(self.path):
            time.sleep(0.02)


def train_with_checkpoints(name: str, run_dir: str, epochs: int = 2, resume: str = "auto",
                           every: int = 1, keep_last: int | None = 3, asynchronous: bool = False,
                           callbacks: tuple = (), lease_expiry: float | None = None, **extra: Any) -> engine.FitResult:
    """Train scenario ``name`` into ``run_dir`` with a checkpoint every ``every`` splits."""
    model, loader = build(name, extra.pop("seed", None))  # another seed: another run of the same setup
    lease = {} if lease_expiry is None else {"lease_expiry_seconds": lease_expiry}
    tier = extra.pop("tier", None)  # (local tier directory, durable every N splits)
    if tier is not None:
        lease.update(local_tier=tier[0], durable_every_n_splits=tier[1])
    writer = extra.pop("writer", "thread")  # "process": a writer process (implies asynchronous)
    checkpoint = engine.CheckpointConfig(every_n_splits=every, keep_last=keep_last,
                                         writer=writer if asynchronous or writer == "process" else "sync",
                                         on_io_error=extra.pop("on_io_error", "raise"),
                                         when_behind=extra.pop("when_behind", "wait"), **lease)
    settings = dict(max_epochs=epochs, run_dir=run_dir, checkpoint=checkpoint, progress_bar="off")
    settings.update(SCENARIOS[name].config_kwargs())
    settings.update(extra)
    return engine.Trainer(trainer_config(**settings), callbacks=list(callbacks)).fit(model, loader, resume=resume)


def stop_after_fence(count: int) -> None:
    """Make this process SIGSTOP itself right after its ``count``-th fence check at a commit
    point (a writer frozen between its last check and the commit, as by a long GC pause)."""
    from engine.checkpoint.store.checkpoint_store import CheckpointStore
    from engine.checkpoint.store.request import NO_CALLBACKS

    original = CheckpointStore.write
    seen = [0]

    def write(self: Any, request: Any, callbacks: Any = NO_CALLBACKS) -> str:
        fence = callbacks.fence

        def fence_then_freeze() -> None:
            fence()
            seen[0] += 1
            if seen[0] == count:
                print("frozen", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)

        return original(self, request, dataclasses.replace(callbacks, fence=None if fence is None else fence_then_freeze))

    CheckpointStore.write = write  # type: ignore[method-assign]


def watchdog_settings(min_timeout_s: float | None, first_timeout_s: float = 60.0) -> dict[str, Any]:
    """TrainerConfig's watchdog with test-sized timeouts (the default's are minutes)."""
    if min_timeout_s is None:
        return {}
    return {"watchdog": engine.Watchdog(min_timeout_s=min_timeout_s, first_timeout_s=first_timeout_s, warmup=3,
                                        poll_s=0.05)}


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("name", choices=sorted(SCENARIOS))
    parser.add_argument("run_dir")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    parser.add_argument("--every", type=lambda value: value if value == "auto" else int(value), default=1,
                        help="checkpoint every N splits, or 'auto' (an overhead budget)")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each split")
    parser.add_argument("--hold-while", default=None, help="from the second split on, wait while this file exists")
    parser.add_argument("--keep-last", type=int, default=3, help="0 keeps every checkpoint")
    parser.add_argument("--lease-expiry", type=float, default=None)
    parser.add_argument("--local-tier", default=None, help="fast checkpoint tier directory")
    parser.add_argument("--durable-every", type=int, default=4, help="with --local-tier: durable every N splits")
    parser.add_argument("--stop-after-fence", type=int, default=0, help="SIGSTOP after the N-th commit-point fence check")
    parser.add_argument("--seed", type=int, default=None, help="another seed: a different run of the same setup")
    parser.add_argument("--writer", choices=["thread", "process"], default="thread",
                        help="'process': checkpoints written by a writer process")
    parser.add_argument("--watchdog", type=float, default=None,
                        help="the watchdog's min_timeout_s (first_timeout_s 60, polled every 0.05 s)")
    parser.add_argument("--when-behind", choices=["wait", "skip"], default="wait", help="CheckpointConfig.when_behind")
    parser.add_argument("--first-timeout", type=float, default=60.0, help="with --watchdog: its first_timeout_s")
    parser.add_argument("--on-io-error", choices=["raise", "warn"], default="raise",
                        help="CheckpointConfig.on_io_error ('warn': a hung writer is abandoned, training goes on)")
    args = parser.parse_args(argv)
    if args.stop_after_fence:
        stop_after_fence(args.stop_after_fence)
    callbacks = (AnnounceStart(), *([SlowDown(args.sleep)] if args.sleep else []),
                 *([HoldWhile(args.hold_while)] if args.hold_while else []))
    result = train_with_checkpoints(args.name, args.run_dir, epochs=args.epochs, every=args.every,
                                    asynchronous=args.asynchronous, callbacks=callbacks,
                                    keep_last=args.keep_last or None, lease_expiry=args.lease_expiry, seed=args.seed,
                                    writer=args.writer, on_io_error=args.on_io_error, when_behind=args.when_behind, **watchdog_settings(args.watchdog, args.first_timeout),
                                    **({"tier": (args.local_tier, args.durable_every)} if args.local_tier else {}))
    print(f"done {result.cursor} resumed_from={result.resumed_from}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def harness_train(run_dir: str, name: str = "tbptt") -> engine.FitResult:
    """A training function for engine.testing.harness (``scenarios:harness_train``)."""
    torch.set_num_threads(1)
    return train_with_checkpoints(name, run_dir)
