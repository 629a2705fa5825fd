"""The TBPTT scenario of scenarios.py on data with one poisoned sample, trained with
``Rollback`` (tests/run/test_rollback.py)::

    python tests/rollback_scenario.py nan|spike RUN_DIR [--sleep SECONDS]

Sample 5 (batch 1 of each epoch: the data is not shuffled) is poisoned from time step 9 on,
that is from split 2 of its batch: ``nan`` makes its input NaN (a non-finite loss), ``spike``
makes its target 1000 times the data's largest (a loss far above ``factor`` times the median).
Each epoch meets it once, so a 2-epoch run rolls back twice. It prints ``training`` when fit
starts and ``done <cursor>`` when it returns.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import engine
from writer_switch import trainer_config
from scenarios import BATCH, AnnounceStart, SlowDown, build, make_dataset

POISONED_SAMPLE, POISONED_FROM_TIME = 5, 9
EVERY = 3  # checkpoints at splits 3 and 6: the anomaly at split 7 rolls back into batch 1
POLICIES = {"nan": engine.Rollback(), "spike": engine.Rollback(factor=10.0, window=3)}


def poisoned_loader(poison: str) -> DataLoader:
    x, y = make_dataset().tensors
    x, y = x.clone(), y.clone()
    if poison == "nan":
        x[POISONED_SAMPLE, POISONED_FROM_TIME:] = float("nan")
    else:
        y[POISONED_SAMPLE, POISONED_FROM_TIME:] = 1000 * y.abs().max()
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def train_poisoned(poison: str, run_dir: str, callbacks: tuple[Any, ...] = (), **config: Any) -> tuple[torch.nn.Module, engine.FitResult]:
    model, _ = build("tbptt")
    settings: dict[str, Any] = dict(max_epochs=2, run_dir=run_dir, progress_bar="off", gradient_clip_val=0.5,
                                    checkpoint=engine.CheckpointConfig(every_n_splits=EVERY, keep_last=None),
                                    anomaly=POLICIES[poison])
    settings.update(config)
    trainer = engine.Trainer(trainer_config(**settings), callbacks=list(callbacks))
    return model, trainer.fit(model, poisoned_loader(poison))


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("poison", choices=sorted(POLICIES))
    parser.add_argument("run_dir")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each split")
    args = parser.parse_args(argv)
    callbacks = (AnnounceStart(), SlowDown(args.sleep)) if args.sleep else (AnnounceStart(),)
    _, result = train_poisoned(args.poison, args.run_dir, callbacks)
    print(f"done {result.cursor}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
