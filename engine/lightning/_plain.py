"""Check that what a LightningModule hands the checkpoint (hyperparameters, ``on_save_checkpoint``'s
dict, a datamodule's state) is plain data the pickle-free format can hold."""

from __future__ import annotations

from typing import Any

import torch

from engine.errors import ModuleContractError


def plain_data(value: Any, where: str, tensors: bool = True) -> Any:
    """``value`` with tuples as lists, or ModuleContractError naming the first entry that is not
    None, a bool, int, float, str, list, str-keyed dict (or tensor, with ``tensors``)."""
    if value is None or isinstance(value, (bool, int, float, str)) or (tensors and isinstance(value, torch.Tensor)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain_data(item, f"{where}[{index}]", tensors) for index, item in enumerate(value)]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise ModuleContractError(f"{where}: key {key!r} is not a string; checkpoints hold plain data only")
        return {key: plain_data(item, f"{where}[{key!r}]", tensors) for key, item in value.items()}
    kept = "numbers, strings, tensors, lists and dicts" if tensors else "numbers, strings, lists and dicts"
    raise ModuleContractError(f"{where} is a {type(value).__name__}, which a checkpoint cannot hold (no pickle): keep "
                              f"{kept} there")
