"""``self.log`` / ``self.log_dict`` as Lightning defines them, recorded through the engine's
metric logger (so metrics.jsonl is written once, and partial epoch sums are checkpointed).

Names, as Lightning gives them to its loggers:

- training, ``on_step`` only (the default): ``name`` in the split's row;
- training, ``on_epoch`` only: ``name`` in the epoch's row, the mean weighted by ``batch_size``;
- training, both: ``name_step`` in the split's row, ``name_epoch`` and ``name`` in the epoch's row
  (``name`` is what Lightning's callbacks monitor);
- validation (``on_epoch``, the default): ``name`` in the pass's row, weighted by ``batch_size``;
  with ``on_step=True`` too, ``name_epoch`` beside it (Lightning's name for the pass value of a
  value logged on both); with ``on_step=True, on_epoch=False``, ``name`` alone. A pass has one
  row: values logged ``on_step`` in validation are reduced over the pass like the others, not
  written per batch.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from engine.errors import ModuleContractError
from engine.loops.logged import MetricLogger

TRAINING, VALIDATION, TEST = "training_step", "validation_step", "test_step"

_REDUCTIONS: dict[object, str] = {"mean": "mean", "sum": "sum", "max": "max", "min": "min",
                                  torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}


def engine_reduction(name: str, reduce_fx: object) -> str:
    """Lightning's ``reduce_fx`` (a name or torch.mean/sum/max/min) as the engine's reduction."""
    try:
        return _REDUCTIONS[reduce_fx]
    except (KeyError, TypeError):
        raise ModuleContractError(f"self.log({name!r}, reduce_fx={reduce_fx!r}): engine.lightning supports 'mean', "
                                  "'sum', 'max', 'min' (or torch.mean/sum/max/min)") from None


def batch_size_of(batch: Any) -> int:
    """Lightning's inferred batch size: the first dimension of the first tensor found in the batch."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in values:
        size = batch_size_of(item)
        if size:
            return size
    return 1


class LightningLog:
    """The sink of a LightningModule's ``self.log`` while the adapter runs it."""

    def __init__(self, engine_logger: Callable[[], MetricLogger | None]) -> None:
        self._engine_logger = engine_logger
        self.hook: str | None = None
        self.batch: Any = None

    def log(self, name: str, value: Any, prog_bar: bool = False, logger: bool | None = None,
            on_step: bool | None = None, on_epoch: bool | None = None, reduce_fx: object = "mean",
            enable_graph: bool = False, sync_dist: bool = False, sync_dist_group: Any = None,
            add_dataloader_idx: bool = True, batch_size: int | None = None, metric_attribute: str | None = None,
            rank_zero_only: bool = False) -> None:
        """Lightning's ``LightningModule.log``; see the module docstring for where values go."""
        sink = self._engine_logger()
        if sink is None or self.hook not in (TRAINING, VALIDATION, TEST):
            raise ModuleContractError(f"self.log({name!r}) in {self.hook or 'a hook'}: engine.lightning records values "
                                      "logged in training_step and validation_step only; log it there")
        if callable(getattr(value, "compute", None)) and callable(getattr(value, "update", None)):
            raise ModuleContractError(f"self.log({name!r}, <{type(value).__name__} metric object>): not supported by "
                                      "engine.lightning; log the tensor it returns for the batch, "
                                      f"self.log({name!r}, metric(preds, target))")
        reduce = engine_reduction(name, reduce_fx)
        number = _synced(value) if sync_dist else value
        weight = batch_size if batch_size is not None else batch_size_of(self.batch)
        if self.hook != TRAINING:
            sink.log(name, number, reduce, weight=weight)
            if on_step and on_epoch is not False:  # Lightning's epoch name of a forked value, as in training
                sink.log(f"{name}_epoch", number, reduce, weight=weight)
            return
        step = True if on_step is None else on_step
        epoch = False if on_epoch is None else on_epoch
        if step and epoch:
            sink.log(f"{name}_step", number, reduce, per_epoch=False)
            sink.log(f"{name}_epoch", number, reduce, weight=weight, per_split=False)
            sink.log(name, number, reduce, weight=weight, per_split=False)
        else:  # neither: the engine logger refuses it with one line
            sink.log(name, number, reduce, weight=weight, per_split=step, per_epoch=epoch)

    def log_dict(self, dictionary: Mapping[str, Any], prog_bar: bool = False, logger: bool | None = None,
                 on_step: bool | None = None, on_epoch: bool | None = None, reduce_fx: object = "mean",
                 enable_graph: bool = False, sync_dist: bool = False, sync_dist_group: Any = None,
                 add_dataloader_idx: bool = True, batch_size: int | None = None, rank_zero_only: bool = False) -> None:
        """Lightning's ``LightningModule.log_dict``: ``log`` for each item."""
        for name, value in dictionary.items():
            self.log(name, value, prog_bar=prog_bar, logger=logger, on_step=on_step, on_epoch=on_epoch,
                     reduce_fx=reduce_fx, sync_dist=sync_dist, batch_size=batch_size)


def _synced(value: Any) -> Any:
    """``sync_dist=True``: the mean over the ranks of a torchrun group (the value itself otherwise)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return value
    tensor = torch.as_tensor(value, dtype=torch.float64).detach().clone()
    torch.distributed.all_reduce(tensor)
    return tensor / torch.distributed.get_world_size()
