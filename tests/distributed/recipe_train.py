"""Trains the ``LM`` of docs/distributed.md's FSDP2 recipe, taken from the page as printed
(the block after ``<!-- fsdp recipe -->``), under torchrun::

    torchrun --nproc-per-node=N tests/distributed/recipe_train.py RUN_DIR OUT_DIR EPOCHS

16 token sequences of 12 steps in batches of 2, shuffled, a checkpoint every split; each rank
writes ``OUT_DIR/final-<rank>.pt`` (the full parameters and Adam's state, gathered) at the end.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # tests/ folders must not shadow the real packages

import pathlib
import re
import types

import torch
from torch.utils.data import DataLoader, TensorDataset

import engine

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
SAMPLES, BATCH, TIME, VOCABULARY = 16, 2, 12, 15


def recipe() -> types.ModuleType:
    """The page's recipe block, run as a module of its own."""
    found = re.findall(r"<!-- fsdp recipe -->\n```python\n(.*?)```", PAGE.read_text(), re.DOTALL)
    assert len(found) == 1, f"{PAGE} must hold the FSDP2 recipe once"
    module = types.ModuleType("fsdp_recipe")
    exec(compile(found[0], str(PAGE), "exec"), module.__dict__)  # noqa: S102 - the project's own page
    return module


def main(run_dir: str, out_dir: str, epochs: str) -> int:
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(100)  # the same full initial parameters on every rank, before sharding
    model = recipe().LM()
    torch.manual_seed(1000 + rank)
    tokens = torch.randint(0, VOCABULARY, (SAMPLES, TIME + 1), generator=torch.Generator().manual_seed(7))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH, shuffle=True)
    config = engine.TrainerConfig(max_epochs=int(epochs), run_dir=run_dir, progress_bar="off", device="cpu",
                                  checkpoint=engine.CheckpointConfig(every_n_splits=1, keep_last=3))
    engine.Trainer(config).fit(model, loader)
    final = {f"param.{key}": value.full_tensor().detach().clone() for key, value in model.state_dict().items()}
    optimizer = model.optimizers()
    for index, parameter in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        for key, value in sorted(optimizer.state[parameter].items()):
            final[f"optim.{index}.{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value
    torch.save(final, pathlib.Path(out_dir) / f"final-{rank}.pt")
    return 0


if __name__ == "__main__":
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, after the real packages
    from rank_exit import leave

    leave(main(*sys.argv[1:]))
