"""Checks on the training data that ``Trainer.fit`` runs before training starts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine.errors import DataError


def check_reiterable(train_data: Any, max_epochs: int | None) -> None:
    """Refuse a one-shot iterator (a generator, ``iter(list)``, ``map(...)``: an object that is
    its own iterator) when more than one epoch can run: it would be empty from the second epoch on.

    Raises:
        DataError: naming the type and what to pass instead.
    """
    if max_epochs == 1 or not isinstance(train_data, Iterator) or iter(train_data) is not train_data:
        return
    epochs = "max_epochs=None" if max_epochs is None else f"max_epochs={max_epochs}"
    raise DataError(
        f"the training data is a one-shot iterator ({type(train_data).__name__}): it is exhausted after "
        f"one epoch, but {epochs} lets more than one run. Pass something that can be iterated again "
        "for each epoch: a torch DataLoader, a list of batches, or an object whose __iter__ returns a new "
        "iterator (for a generator function, a class with __iter__ calling it); or set max_epochs=1"
    )
