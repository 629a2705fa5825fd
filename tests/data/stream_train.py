"""Training on streams, as a script the stream tests start, kill and resume::

    python tests/data/stream_train.py KIND RUN_DIR [--sleep SECONDS] [--epochs N]

KIND is ``stream-<workers>`` (an IterableDataset with state_dict(), its workers sharding it),
``hf-<workers>`` (Hugging Face ``datasets`` streaming local JSONL shards, mapped, each rank
taking its part with split_dataset_by_node under torchrun), ``hf_shuffled-<workers>`` and
``hf_shuffled_after_map-<workers>`` (the same through a ``.shuffle(seed, buffer_size)`` buffer
before or after the map), ``mixture-<on_exhausted>`` (an
engine.data.Mixture of a stream with state and a list), ``combined-<mode>`` (the same two as
several training loaders, ``fit(module, {...}, mode=...)``). Each step logs which
samples it saw (``first``, ``last``, ``sum`` of their ids) into metrics.jsonl, so two runs that
fed the same samples to the same steps have the same metrics file. Prints ``training`` when fit
starts; ``--out OUT`` writes the final parameters to ``OUT/final-<rank>.pt``; ``STREAM_KILL=
RANK/FAULTS`` arms engine fault points (SPLITLOOP_FAULTS syntax) on that rank's first try.
"""

from __future__ import annotations

import os
import sys

if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # tests/ folders must not shadow the real packages
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (writer_switch), last

import argparse
import json
import pathlib
import random
import time
from typing import Any

import numpy
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import engine
import engine.data
from writer_switch import trainer_config

SAMPLES, BATCH, SHARDS = 48, 4, 4
BUFFER = 7  # examples in a Hugging Face shuffle buffer: it spans shards and batches


class CountingStream(IterableDataset):
    """Sample ids 0..SAMPLES-1, each worker taking every num_workers-th one, with noise drawn
    from a generator that is part of the state (so the state must restore it exactly)."""

    def __init__(self, samples: int = SAMPLES) -> None:
        self.samples = samples
        self.position = 0
        self.epoch = 0
        self.generator = torch.Generator().manual_seed(7)
        self.loads_state = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        mine = list(range(worker, self.samples, workers))
        if self.position == 0:
            self.generator.manual_seed(1000 * self.epoch + worker)
        while self.position < len(mine):
            sample = mine[self.position]
            self.position += 1
            noise = torch.randn(1, generator=self.generator)
            yield {"id": torch.tensor(sample), "x": torch.tensor([float(sample % 7)]) + 0.1 * noise}
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "epoch": self.epoch, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loads_state += 1
        self.position, self.epoch = state["position"], state["epoch"]
        self.generator.set_state(state["generator"])


def write_shards(folder: pathlib.Path) -> list[str]:
    """SHARDS local JSONL files of SAMPLES samples in all (no network)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(SHARDS):
        path = folder / f"shard-{shard}.jsonl"
        lines = [json.dumps({"id": sample, "x": float(sample % 5)}) for sample in range(shard, SAMPLES, SHARDS)]
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    return paths


def hf_stream(folder: pathlib.Path, shuffle: str = "") -> Any:
    """load_dataset("json", streaming=True) over local shards, mapped, split by node; with
    ``shuffle="before-map"`` or ``"after-map"`` shuffled through a buffer of BUFFER examples
    there (datasets iterates the buffer as Arrow tables before the map, as examples after it)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets
    from datasets.distributed import split_dataset_by_node

    stream = datasets.load_dataset("json", data_files=write_shards(folder), split="train", streaming=True)
    if shuffle == "before-map":
        stream = stream.shuffle(seed=11, buffer_size=BUFFER)
    stream = stream.map(lambda example: {"x": [example["x"] * 2.0]})
    if shuffle == "after-map":
        stream = stream.shuffle(seed=11, buffer_size=BUFFER)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        stream = split_dataset_by_node(stream, rank=int(os.environ["RANK"]), world_size=world)
    return stream.with_format("torch")


class Model(engine.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.dropout = torch.nn.Dropout(0.2)

    def training_step(self, batch: Any) -> Any:
        parts = [batch] if "id" in batch else [batch[name] for name in sorted(batch)]  # several loaders: a dict each
        batch = {key: torch.cat([part[key].reshape(-1) for part in parts]) for key in ("id", "x")}
        ids = batch["id"].reshape(-1).to(torch.float64)
        self.log("first", float(ids[0]))
        self.log("last", float(ids[-1]))
        self.log("sum", float(ids.sum()))
        x = batch["x"].reshape(-1, 1).to(torch.float32)
        return self.layer(self.dropout(x)).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.5)


class Announce(engine.Callback):
    def __init__(self, sleep: float) -> None:
        self.sleep = sleep

    def on_fit_start(self, view: engine.RunView) -> None:
        print("training", flush=True)

    def on_split_end(self, view: engine.RunView) -> None:
        time.sleep(self.sleep)


def list_batches(count: int, first_id: int) -> list[dict[str, torch.Tensor]]:
    """A source without state: a list of batches (resumed by index)."""
    ids = torch.arange(first_id, first_id + count * BATCH)
    return [{"id": chunk, "x": (chunk % 3).float().reshape(-1, 1)} for chunk in ids.split(BATCH)]


def make_mixture(on_exhausted: str) -> engine.data.Mixture:
    """A stream with state in a DataLoader with 2 workers, and a list, mixed 2:1."""
    sources = {"stream": DataLoader(CountingStream(32), batch_size=BATCH, num_workers=2),
               "list": list_batches(5, 1000)}
    return engine.data.Mixture(sources, weights=[2.0, 1.0], seed=5, on_exhausted=on_exhausted)


def make_data(kind: str, run_dir: str) -> Any:
    name, workers = kind.split("-", 1)
    if name == "mixture":
        return make_mixture(workers)
    if name == "combined":  # fit(module, {name: loader}, mode=...)
        return {"stream": DataLoader(CountingStream(24), batch_size=BATCH, num_workers=2), "list": list_batches(4, 1000)}
    if name == "stream":
        dataset = CountingStream()
    else:  # hf, hf_shuffled (before the map), hf_shuffled_after_map
        shuffle = {"hf": "", "hf_shuffled": "before-map", "hf_shuffled_after_map": "after-map"}[name]
        dataset = hf_stream(pathlib.Path(run_dir).parent / "shards", shuffle)
    return DataLoader(dataset, batch_size=BATCH, num_workers=int(workers))


def train(kind: str, run_dir: str, epochs: int = 2, sleep: float = 0.0, resume: str = "auto",
          keep_last: int | None = 3, out_dir: str | None = None) -> engine.FitResult:
    torch.manual_seed(0)
    random.seed(0)
    numpy.random.seed(0)
    model = Model()
    config = trainer_config(max_epochs=epochs, run_dir=run_dir, progress_bar="off",
                            checkpoint=engine.CheckpointConfig(every_n_splits=1, keep_last=keep_last))
    mode = {"mode": kind.split("-", 1)[1]} if kind.startswith("combined") else {}
    result = engine.Trainer(config, callbacks=[Announce(sleep)]).fit(model, make_data(kind, run_dir), resume=resume, **mode)
    if out_dir:
        final = {f"param.{key}": value.detach().clone() for key, value in model.state_dict().items()}
        torch.save(final, pathlib.Path(out_dir) / f"final-{os.environ.get('RANK', '0')}.pt")
    return result


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("kind")
    parser.add_argument("run_dir")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--out", default=None, help="write the final parameters to OUT/final-<rank>.pt")
    args = parser.parse_args(argv)
    kill = os.environ.get("STREAM_KILL", "")  # "RANK/FAULTS": arm that rank's first try (under torchrun)
    rank, _, faults = kill.partition("/")
    if faults and rank == os.environ.get("RANK", "0") and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.environ["SPLITLOOP_FAULTS"] = faults
    result = train(args.kind, args.run_dir, args.epochs, args.sleep, out_dir=args.out)
    print(f"done {result.cursor} resumed_from={result.resumed_from}")
    return 0


if __name__ == "__main__":
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, after the real packages
    from rank_exit import leave

    leave(main(sys.argv[1:]))
