"""The smallest trainable module, shared by the misuse tests (tests/run/test_misuse_*.py)."""

from __future__ import annotations

import torch
from torch import nn

import engine


class Plain(engine.Module):
    """One linear layer on rows of 3 features (a batch may also be a (features, ...) tuple),
    seeded; trained by ``optimizer`` (SGD by default)."""

    def __init__(self, optimizer=torch.optim.SGD) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 1)
        self.optimizer_class = optimizer

    def training_step(self, batch):
        features = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.layer(features).pow(2).mean()

    def configure_optimizers(self):
        return self.optimizer_class(self.parameters(), lr=0.1)
