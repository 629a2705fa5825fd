"""Engine overhead on a TBPTT workload: ``engine.Trainer`` against a hand-written loop.

What is measured: the wall time of one training run of a character-level LSTM language model
(embedding 32, LSTM hidden 128, Adam) on batches of 16 sequences x 256 time steps, each cut into
8 TBPTT splits of 32 steps, run

* through ``engine.Trainer`` with ``TrainerConfig(run_dir=None, checkpoint=None,
  progress_bar="off")`` and an ``engine.Module`` with ``tbptt_split_length = 32``, and
* through a hand-written loop doing the same work per split: ``zero_grad``, forward,
  ``loss.item()`` (what logging costs), backward, ``optimizer.step()``, detach the hidden state.

Both start from the same seed and see the same batches; the script checks with ``torch.equal``
that their final parameters are identical, which proves they did the same work. Only the run is
timed (building the trainer and the optimizer included); building the model is not.

Runs are interleaved in pairs, each pair back to back, with the order inside a pair alternating
(engine first, then hand-written first) so that neither side always runs on a warmer machine.
The reported figure is the median of the per-pair ratios engine / hand-written of wall time
(``time.perf_counter``): each pair is measured under the same machine conditions, so the ratio
of a pair cancels slow drift that a ratio of two medians would not. Absolute times are printed
for context only. On a 2-core machine shared with other work single pairs vary by +-25%; the
engine's own per-split work (a few hundred microseconds against ~15 ms of compute per split)
is below that, so expect a ratio within noise of 1.0.

Reproduce (from the repository root, in the environment of the README)::

    python benchmarks/loop_overhead.py              # 7 pairs, 60-90 s on 2 cores
    python benchmarks/loop_overhead.py --quick      # a few seconds, for tests

The last line is ``overhead ratio: X.XXX (engine / hand-written, median of N interleaved runs)``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import engine

VOCABULARY = 64
EMBEDDING = 32
HIDDEN = 128
BATCH_SIZE = 16
SEQUENCE_LENGTH = 256
SPLIT_LENGTH = 32
# One intra-op thread: on a 2-core machine shared with other work, 2 threads oversubscribe and
# make every split several times slower and far noisier; the engine's overhead is single-threaded
# Python either way.
THREADS = 1
SEED = 1234

Batch = tuple[torch.Tensor, torch.Tensor]
Hidden = tuple[torch.Tensor, torch.Tensor]


class CharLSTM(engine.Module):
    """Embedding -> LSTM -> linear; the same module serves the engine and the hand-written loop."""

    tbptt_split_length = SPLIT_LENGTH

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCABULARY, EMBEDDING)
        self.rnn = torch.nn.LSTM(EMBEDDING, HIDDEN, batch_first=True)
        self.head = torch.nn.Linear(HIDDEN, VOCABULARY)

    def loss_and_hidden(self, batch: Batch, hidden: Hidden | None) -> tuple[torch.Tensor, Hidden]:
        inputs, targets = batch
        output, hidden = self.rnn(self.embed(inputs), hidden)
        loss = torch.nn.functional.cross_entropy(self.head(output).flatten(0, 1), targets.flatten())
        return loss, hidden

    def training_step(self, batch: Batch, hidden: Hidden | None) -> tuple[torch.Tensor, Hidden]:
        return self.loss_and_hidden(batch, hidden)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def make_batches(count: int) -> list[Batch]:
    """``count`` batches of (inputs, next-character targets), the same on every call."""
    generator = torch.Generator().manual_seed(SEED)
    batches = []
    for _ in range(count):
        codes = torch.randint(VOCABULARY, (BATCH_SIZE, SEQUENCE_LENGTH + 1), generator=generator)
        batches.append((codes[:, :-1].contiguous(), codes[:, 1:].contiguous()))
    return batches


def fresh_model() -> CharLSTM:
    torch.manual_seed(SEED)
    return CharLSTM()


def run_engine(model: CharLSTM, batches: list[Batch]) -> None:
    config = engine.TrainerConfig(max_epochs=1, run_dir=None, checkpoint=None, progress_bar="off")
    engine.Trainer(config).fit(model, batches)


def run_hand_written(model: CharLSTM, batches: list[Batch]) -> None:
    optimizer = make_optimizer(model)
    for inputs, targets in batches:
        hidden = None
        for start in range(0, SEQUENCE_LENGTH, SPLIT_LENGTH):
            split = (inputs[:, start:start + SPLIT_LENGTH], targets[:, start:start + SPLIT_LENGTH])
            optimizer.zero_grad()
            loss, hidden = model.loss_and_hidden(split, hidden)
            loss.item()  # what logging the loss costs: a host sync per split, as in the engine
            loss.backward()
            optimizer.step()
            hidden = (hidden[0].detach(), hidden[1].detach())


Runner = Callable[[CharLSTM, list[Batch]], None]


def timed_run(runner: Runner, batches: list[Batch]) -> tuple[float, CharLSTM]:
    """Seconds one run takes (model built outside the timing), and the trained model."""
    model = fresh_model()
    started = time.perf_counter()
    runner(model, batches)
    return time.perf_counter() - started, model


def same_parameters(first: torch.nn.Module, second: torch.nn.Module) -> bool:
    pairs = zip(first.state_dict().items(), second.state_dict().items())
    return all(name_a == name_b and torch.equal(a, b) for (name_a, a), (name_b, b) in pairs)


def measure_pair(index: int, batches: list[Batch]) -> tuple[float, float, bool]:
    """One engine run and one hand-written run back to back; the order alternates with ``index``."""
    if index % 2 == 0:
        engine_seconds, engine_model = timed_run(run_engine, batches)
        hand_seconds, hand_model = timed_run(run_hand_written, batches)
    else:
        hand_seconds, hand_model = timed_run(run_hand_written, batches)
        engine_seconds, engine_model = timed_run(run_engine, batches)
    return engine_seconds, hand_seconds, same_parameters(engine_model, hand_model)


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="interleaved pairs (default 7, 3 with --quick)")
    parser.add_argument("--batches", type=int, default=None, help="batches per run (default 40, 3 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a small run (seconds)")
    parser.add_argument("--smoke", action="store_true", help="one pair of one-batch runs (CI runs it; the figures mean nothing)")
    arguments = parser.parse_args()
    if arguments.repeats is None:
        arguments.repeats = 1 if arguments.smoke else 3 if arguments.quick else 7
    if arguments.batches is None:
        arguments.batches = 1 if arguments.smoke else 3 if arguments.quick else 40
    if arguments.repeats < 1 or arguments.batches < 1:
        parser.error("--repeats and --batches must be positive")
    return arguments


def run_pairs(repeats: int, batches: list[Batch]) -> tuple[list[tuple[float, float]], bool]:
    """``repeats`` interleaved (engine, hand-written) times in seconds, and whether every pair
    ended with equal parameters."""
    pairs, all_equal = [], True
    for index in range(repeats):
        engine_seconds, hand_seconds, equal = measure_pair(index, batches)
        pairs.append((engine_seconds, hand_seconds))
        all_equal = all_equal and equal
        print(f"pair {index + 1}: engine {engine_seconds:.3f} s, hand-written {hand_seconds:.3f} s, "
              f"ratio {engine_seconds / hand_seconds:.3f}, parameters equal: {equal}")
    return pairs, all_equal


def main() -> None:
    arguments = parse_arguments()
    torch.set_num_threads(THREADS)
    batches = make_batches(arguments.batches)
    splits = arguments.batches * (SEQUENCE_LENGTH // SPLIT_LENGTH)
    print(f"workload: LSTM hidden {HIDDEN}, {arguments.batches} batches of {BATCH_SIZE}x{SEQUENCE_LENGTH}, "
          f"{splits} splits of {SPLIT_LENGTH} per run, torch threads {THREADS}, torch {torch.__version__}")
    measure_pair(0, batches[:1])  # warm-up: first-call costs of both paths, not timed
    pairs, all_equal = run_pairs(arguments.repeats, batches)
    engine_median = statistics.median(e for e, _ in pairs)
    hand_median = statistics.median(h for _, h in pairs)
    print(f"median engine {engine_median:.3f} s, median hand-written {hand_median:.3f} s, "
          f"overhead per split {(engine_median - hand_median) / splits * 1e3:.3f} ms")
    print(f"final parameters torch.equal in every pair: {all_equal}")
    # Median of the per-pair ratios, not a ratio of medians (see the module docstring).
    ratio = statistics.median(e / h for e, h in pairs)
    print(f"overhead ratio: {ratio:.3f} (engine / hand-written, median of {arguments.repeats} interleaved runs)")


if __name__ == "__main__":
    main()
