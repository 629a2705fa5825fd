"""The validated TBPTT run of validation_scenarios.py, stopped early by ``EarlyStopping`` on a
noisy metric (it stops at a split boundary in the middle of epoch 1), for the subprocess tests
of finished runs (tests/run/test_finished_runs.py)::

    python tests/early_stop_scenario.py RUN_DIR

It prints ``done: <optimizer steps> optimizer steps; stopped: <reason>`` when ``fit`` returns.
"""

from __future__ import annotations

import sys

import torch

import engine
from validation_scenarios import best_policy, train_validated

EPOCHS, EVERY_STEPS = 3, 3


def early_stopper() -> engine.EarlyStopping:
    return engine.EarlyStopping("val_noise", mode="max", patience=2)


def train_early_stopped(run_dir: str) -> engine.FitResult:
    _, result = train_validated(run_dir, epochs=EPOCHS, every_steps=EVERY_STEPS, callbacks=(early_stopper(),),
                                checkpoint=best_policy())
    return result


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    result = train_early_stopped(argv[0])
    print(f"done: {result.optimizer_steps} optimizer steps; stopped: {result.stop_reason}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
