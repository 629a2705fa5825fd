"""Tiny modules that several test files train, written once."""

from __future__ import annotations

import torch

import engine


class Regression(engine.Module):
    """A linear layer ``net`` (``features`` inputs, one output) whose loss is the mean square
    of its output, trained by SGD; ``steps`` counts the training steps it took.

    Its initial weights come from the global RNG when it is built, as ``torch.nn.Linear``'s.
    """

    def __init__(self, features: int = 2, lr: float = 0.1) -> None:
        super().__init__()
        self.net = torch.nn.Linear(features, 1)
        self.lr = lr
        self.steps = 0

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)
