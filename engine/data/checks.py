"""Checks on the training data that ``Trainer.fit`` runs before training starts."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Set
from typing import Any

from engine.errors import ConfigError, DataError


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


def check_batch_source(train_data: Any) -> None:
    """Refuse containers that iterate but are almost surely not batches: a string or bytes (its
    characters), a dict (its keys), a set (in an order that changes between processes, so a
    resume would not continue the same epoch), a map-style Dataset that is not wrapped in a
    DataLoader, and data of length 0 (before anything is written to the run directory).

    Raises:
        DataError: naming the type and what to pass instead.
    """
    if isinstance(train_data, (str, bytes, bytearray)):
        raise DataError(f"the training data is a {type(train_data).__name__} ({train_data[:40]!r}): iterating it "
                        "yields single characters, not batches; pass a DataLoader or a list of batches")
    if isinstance(train_data, Mapping):
        raise DataError(f"the training data is a {type(train_data).__name__}: iterating it yields its keys "
                        f"({list(train_data)[:3]!r}...), not batches; pass a list of batches (e.g. [batch_dict]) "
                        "or a DataLoader")
    if isinstance(train_data, Set):
        raise DataError(f"the training data is a {type(train_data).__name__}: its order is not fixed, so a resumed "
                        "run would not continue the same epoch; pass a list of batches or a DataLoader")
    try:
        empty = len(train_data) == 0
    except TypeError:  # no length (an IterableDataset's DataLoader, a generator): found out when iterated
        empty = False
    if empty:
        raise DataError("the training data is empty: len(train_data) is 0")
    if not hasattr(train_data, "__iter__") and hasattr(train_data, "__getitem__") and hasattr(train_data, "__len__"):
        raise DataError(f"the training data is a {type(train_data).__name__}, a dataset of samples, not of batches; "
                        "wrap it in torch.utils.data.DataLoader(dataset, batch_size=...)")


def check_val_data(val_data: Any, val_at_epoch_end: bool, val_every_n_steps: int | None) -> None:
    """Refuse validation data that cannot be used or would never be used, and validation asked
    for without data.

    Raises:
        ConfigError: a string where val_data goes (resume passed positionally?), or val_data
            and the TrainerConfig validation fields disagree.
        DataError: val_data is not iterable, or is a one-shot iterator.
    """
    if isinstance(val_data, (str, bytes)):
        raise ConfigError(f"fit: val_data must be re-iterable batches, got the string {val_data!r} "
                          "(pass resume= as a keyword)")
    if val_data is None:
        if val_every_n_steps is not None:
            raise ConfigError(f"TrainerConfig.val_every_n_steps={val_every_n_steps!r} but fit got no val_data, so no "
                              "validation would run; pass val_data to fit or drop val_every_n_steps")
        return
    if not isinstance(val_data, Iterable):
        raise DataError(f"fit: val_data must be re-iterable batches (a DataLoader or a list), got "
                        f"{type(val_data).__name__}")
    if not val_at_epoch_end and val_every_n_steps is None:
        raise ConfigError("fit got val_data but TrainerConfig.val_at_epoch_end=False and val_every_n_steps=None, "
                          "so no validation would run; set val_every_n_steps, val_at_epoch_end=True, or drop val_data")
    # Not iter(val_data): a DataLoader's __iter__ draws a seed from the global RNG.
    if isinstance(val_data, Iterator):
        raise DataError("fit: val_data is a one-shot iterator (a generator?); validation runs many times: "
                        "pass a DataLoader or a list")
