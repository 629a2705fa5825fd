"""A LightningModule trained through engine.lightning.Trainer under torchrun (tests/lightning)::

    torchrun --nproc-per-node=2 tests/lightning/lit_torchrun.py RUN_DIR

Each rank logs its rank with and without ``sync_dist`` and what ``self.trainer`` tells it."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run from tests/lightning: this folder must not shadow the real `lightning`


import pytorch_lightning as pl
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import engine
import engine.lightning
from lit_modules import LitAutoEncoder, vectors


class RankLogger(LitAutoEncoder):
    def training_step(self, batch, batch_idx):
        rank = float(self.trainer.global_rank)
        self.log("rank_synced", rank, on_step=False, on_epoch=True, sync_dist=True)
        self.log("rank_plain", rank, on_step=False, on_epoch=True)
        self.log("world_size", float(self.trainer.world_size), on_step=False, on_epoch=True)
        self.log("global_zero", float(self.trainer.is_global_zero), on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


def main(run_dir: str) -> int:
    pl.seed_everything(3, verbose=False)
    config = engine.TrainerConfig(max_epochs=1, run_dir=run_dir, progress_bar="off")
    engine.lightning.Trainer(config).fit(RankLogger(), DataLoader(vectors(16, 1), batch_size=4))
    return 0


if __name__ == "__main__":
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, after the real packages
    from rank_exit import leave

    leave(main(sys.argv[1]))
