"""Resume cost of a stream with state: the same at batch 100 and at batch 10,000.

What is measured: a ``DataLoader`` over an ``IterableDataset`` with ``state_dict()`` (one
sample per batch, a linear model) is trained to batch N and checkpointed there, in a fresh
``memory://`` run directory, for N = 100 and N = 10,000. Then ``fit`` is called again with
``resume="auto"`` and one more step to do; the time from that call to the end of the first
resumed split (``on_split_end``) is the resume cost. A stream with state loads its state, so the
cost does not grow with N: the figure printed is the ratio of the two (goal <= 1.5). With
``--stateless`` the same stream without ``state_dict()`` is replayed (batches drawn and dropped)
instead, to show what the ratio is without the saved state.

Each resume is repeated ``--repeats`` times, the two positions interleaved (the median is taken,
after one warm-up resume); training to N is not timed.
Absolute times are printed for context only.

Reproduce (from the repository root, in the environment of the README)::

    python benchmarks/resume_position.py               # about a minute on 2 cores
    python benchmarks/resume_position.py --stateless   # the replay, for comparison

The last line is ``resume at 10000 / resume at 100: X``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

import engine

SAMPLES = 20000


class Stream(IterableDataset):
    """Samples 0, 1, 2, ...; its position is its state."""

    def __init__(self, samples: int) -> None:
        self.samples, self.position = samples, 0

    def __iter__(self):
        while self.position < self.samples:
            self.position += 1
            yield torch.tensor([float(self.position % 13)])
        self.position = 0


class StreamWithState(Stream):
    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


class Linear(engine.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch: Any) -> Any:
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.001)


class FirstSplit(engine.Callback):
    def __init__(self) -> None:
        self.at: float | None = None

    def on_split_end(self, view: engine.RunView) -> None:
        if self.at is None:
            self.at = time.perf_counter()


def fit(run_dir: str, steps: int, every: int, stateless: bool, samples: int) -> float:
    """Train to ``steps`` (resuming what ``run_dir`` holds); seconds from the call to the first split's end."""
    stream = Stream(samples) if stateless else StreamWithState(samples)
    config = engine.TrainerConfig(max_epochs=1, max_steps=steps, run_dir=run_dir, progress_bar="off",
                                  checkpoint=engine.CheckpointConfig(every_n_splits=every, at_epoch_end=False))
    first = FirstSplit()
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.Trainer(config, callbacks=[first]).fit(Linear(), DataLoader(stream, batch_size=None), resume="auto")
    assert first.at is not None
    return first.at - started


def checkpointed_at(position: int, stateless: bool, samples: int) -> str:
    """A run directory whose one checkpoint is at batch ``position``."""
    base = f"memory://resume-position-{uuid.uuid4().hex}"
    fit(base, position, position, stateless, samples)
    return base


def resume_once(base: str, position: int, stateless: bool, samples: int) -> float:
    run_dir = f"{base}-{uuid.uuid4().hex}"
    copy_run(base, run_dir)
    return fit(run_dir, position + 1, position + 1, stateless, samples)


def copy_run(source: str, target: str) -> None:
    import fsspec

    fs, root = fsspec.core.url_to_fs(source)
    _, target_root = fsspec.core.url_to_fs(target)
    for path in fs.find(root):
        fs.pipe_file(target_root + path[len(root):], fs.cat_file(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="resumes timed per position (median)")
    parser.add_argument("--stateless", action="store_true", help="a stream without state_dict() (replayed)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    positions = (100, 10000)
    bases = {position: checkpointed_at(position, args.stateless, SAMPLES) for position in positions}
    resume_once(bases[100], 100, args.stateless, SAMPLES)  # warm-up: first-call costs of the process
    times: dict[int, list[float]] = {position: [] for position in positions}
    for repeat in range(args.repeats):  # interleaved, the order alternating, so drift hits both alike
        for position in positions if repeat % 2 == 0 else reversed(positions):
            times[position].append(resume_once(bases[position], position, args.stateless, SAMPLES))
    costs = {position: statistics.median(values) for position, values in times.items()}
    for position in positions:
        print(f"resume at {position}: {costs[position] * 1000:.1f} ms (median of {args.repeats})")
    print(f"resume at 10000 / resume at 100: {costs[10000] / costs[100]:.2f}")


if __name__ == "__main__":
    main()
