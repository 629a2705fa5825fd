"""A tiny FSDP2-sharded training run, started by torchrun from the tests (tests/distributed)::

    torchrun --nproc-per-node=2 tests/distributed/fsdp_train.py RUN_DIR OUT_DIR [options]

An embedding, an LSTM trained with TBPTT (hidden state carried across batches) and a head, AdamW,
``fully_shard`` on the embedding, the LSTM and the root over a CPU device mesh (gloo): in
``Module.configure_model`` by default, before ``fit`` with ``--shard-before-fit`` (the script then
starts the group with ``engine.distributed.init_process_group``; ``--start-timeout`` bounds it
and ``TrainerConfig.start_timeout``). The vocabulary (15) does not divide by the world size, so
shards are uneven. Each worker writes, when its fit
ends, ``OUT_DIR/final-<rank>.pt``: the full (gathered) parameters ``param.*``, the optimizer state
gathered ``optim.<index>.<key>`` (Adam's ``step`` and moments), its RNG state and its carried
hidden state; and its pid as ``OUT_DIR/pid-<rank>-<restart>`` when it starts. ``KILLS`` and
``--slow`` work as in dist_train.py. For the world-size-change tests (test_reshard.py):
``--whole-batches`` trains without TBPTT (one split per batch, a fresh hidden state each, so
every checkpoint is at a batch boundary), and ``--record-steps ATTEMPT`` makes
each sample carry its id and each rank append one line per optimizer step to
``OUT_DIR/steps-<ATTEMPT>-<rank>.jsonl`` (the step, the ids of the samples trained on), as
elastic_train.py does.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # tests/ folders must not shadow the real packages

import argparse
import json
import pathlib
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import engine

SAMPLES, BATCH, TIME, VOCAB, SPLIT = 16, 2, 12, 15, 4
VAL_SAMPLES = 10


class Model(engine.Module):
    def __init__(self, shard_in_configure_model: bool = True, tbptt: bool = True) -> None:
        super().__init__()
        self.tbptt_split_length = SPLIT if tbptt else None
        self.carry_hidden_across_batches = tbptt
        self.embedding = torch.nn.Embedding(VOCAB, 8)
        self.rnn = torch.nn.LSTM(8, 8, batch_first=True)
        self.head = torch.nn.Linear(8, VOCAB)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.shard_in_configure_model = shard_in_configure_model
        self.last_hidden: Any = None
        self.last_ids: list[int] = []

    def configure_model(self) -> None:
        if self.shard_in_configure_model:
            shard(self)

    def training_step(self, batch: Any, hidden: Any = None) -> Any:
        tokens, targets, *ids = batch
        self.last_ids = [int(i) for i in ids[0][:, 0]] if ids else []
        out, hidden = self.rnn(self.embedding(tokens), hidden)
        self.last_hidden = hidden
        logits = self.head(out)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        return (loss, hidden) if self.tbptt_split_length else loss

    def validation_step(self, batch: Any, hidden: Any = None) -> Any:
        tokens, targets = batch
        out, hidden = self.rnn(self.embedding(tokens), hidden)
        logits = self.head(out)
        self.log("val_tokens", float(targets.numel()), reduce="sum")
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)), hidden

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)


def shard(model: Model) -> None:
    """fully_shard the embedding, the LSTM and the root over every rank (a CPU mesh)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.embedding, mesh=mesh)
    fully_shard(model.rnn, mesh=mesh)
    fully_shard(model, mesh=mesh)


def gathered(value: Any) -> Any:
    """The full tensor of a DTensor (a collective: every rank calls it in the same order)."""
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full.detach().clone()


def final_state(model: Model, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    final = {f"param.{key}": gathered(value) for key, value in model.state_dict().items()}
    for index, parameter in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        for key, value in sorted(optimizer.state[parameter].items()):
            final[f"optim.{index}.{key}"] = gathered(value)
    final["rng"] = torch.get_rng_state()
    if model.last_hidden is not None:  # None when this process trained nothing (a finished run)
        final["hidden.h"], final["hidden.c"] = (t.detach().clone() for t in model.last_hidden)
    return final


class Sleep(engine.Callback):
    """Slows training down and counts this process's splits in a file the test watches."""

    def __init__(self, seconds: float, counter: pathlib.Path) -> None:
        self.seconds, self.counter, self.splits = seconds, counter, 0

    def on_split_end(self, view: engine.RunView) -> None:
        import time
        self.splits += 1
        self.counter.write_text(str(self.splits))
        time.sleep(self.seconds)


class RecordSteps(engine.Callback):
    """Appends each optimizer step's sample ids (as elastic_train.py's Record does)."""

    def __init__(self, model: Model, path: pathlib.Path) -> None:
        self.model, self.path = model, path

    def on_split_end(self, view: engine.RunView) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps({"step": view.optimizer_steps, "ids": self.model.last_ids}) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    parser.add_argument("--accumulate", type=int, default=2, help="accumulate_grad (over splits)")
    parser.add_argument("--clip", type=float, default=0.5, help="gradient_clip_val (norm)")
    parser.add_argument("--slow", type=float, default=0.0, help="sleep per split (seconds), to be killed")
    parser.add_argument("--whole-batches", action="store_true", help="no TBPTT: one split per batch")
    parser.add_argument("--record-steps", default=None, help="ATTEMPT: record each step's sample ids")
    parser.add_argument("--start-timeout", type=float, default=engine.TrainerConfig.start_timeout,
                        help="TrainerConfig.start_timeout and init_process_group's (seconds)")
    parser.add_argument("--shard-before-fit", action="store_true", help="fully_shard before fit, not in configure_model")
    parser.add_argument("--validate", action="store_true",
                        help=f"validate at each epoch end on {VAL_SAMPLES} samples ({VAL_SAMPLES // BATCH} batches: "
                             "not a multiple of the world size)")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = pathlib.Path(args.out_dir)
    for kill in filter(None, os.environ.get("KILLS", "").split(";")):
        kill_restart, kill_rank, faults = kill.split("/")
        if (int(kill_restart), int(kill_rank)) == (restart, rank):
            os.environ["SPLITLOOP_FAULTS"] = faults
    torch.manual_seed(100)  # the same full initial parameters on every rank, before sharding
    model = Model(shard_in_configure_model=not args.shard_before_fit, tbptt=not args.whole_batches)
    if args.shard_before_fit and "WORLD_SIZE" in os.environ:
        # Not torch.distributed.init_process_group: the engine's joins torchrun's store so that a
        # restarted group does not meet the previous try's keys (docs/distributed.md).
        engine.distributed.init_process_group(start_timeout=args.start_timeout)
        shard(model)
    torch.manual_seed(1000 + rank)
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (SAMPLES, TIME + 1), generator=generator)
    ids = [torch.arange(SAMPLES)[:, None].expand(SAMPLES, TIME)] if args.record_steps is not None else []
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:], *ids), batch_size=BATCH, shuffle=True)
    callbacks: list[engine.Callback] = [Sleep(args.slow, out / f"splits-{rank}")] if args.slow else []
    if args.record_steps is not None:
        callbacks.append(RecordSteps(model, out / f"steps-{args.record_steps}-{rank}.jsonl"))
    config = engine.TrainerConfig(
        max_epochs=args.epochs, run_dir=args.run_dir, progress_bar="off", accumulate_grad=args.accumulate,
        device="cpu", gradient_clip_val=args.clip,
        checkpoint=engine.CheckpointConfig(every_n_splits=args.every, keep_last=3, writer=checkpoint_writer(args.asynchronous)),
        val_at_epoch_end=args.validate, start_timeout=args.start_timeout,
    )
    (out / f"pid-{rank}-{restart}").write_text(str(os.getpid()))
    val_tokens = torch.randint(0, VOCAB, (VAL_SAMPLES, TIME + 1), generator=generator)
    val_data = DataLoader(TensorDataset(val_tokens[:, :-1], val_tokens[:, 1:]), batch_size=BATCH) if args.validate else None
    result = engine.Trainer(config, callbacks).fit(model, loader, val_data)
    if "WORLD_SIZE" in os.environ and not all(hasattr(p, "device_mesh") for p in model.parameters()):
        raise SystemExit("the model was not sharded: Module.configure_model was not called")
    torch.save(final_state(model, model.optimizers()), out / f"final-{rank}.pt")  # type: ignore[arg-type]
    print(f"rank {rank} done: {result.stop_reason} steps={result.optimizer_steps}", flush=True)
    return 0



def checkpoint_writer(asynchronous: bool) -> str:
    """'process' under SPLITLOOP_TEST_WRITER=process (tests/writer_switch.py), else 'thread' with
    ``--async``, else 'sync'."""
    if os.environ.get("SPLITLOOP_TEST_WRITER") == "process":
        return "process"
    return "thread" if asynchronous else "sync"

if __name__ == "__main__":
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, after the real packages
    from rank_exit import leave

    leave(main())
