"""The user's side of the contract: subclass :class:`Module`.

Minimal example::

    class CharLM(engine.Module):
        tbptt_split_length = 16          # TBPTT on; None (the default) turns it off

        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(8, 32, batch_first=True)
            self.head = torch.nn.Linear(32, 8)

        def training_step(self, batch, hidden):
            x, y = batch
            out, hidden = self.rnn(x, hidden)
            return torch.nn.functional.cross_entropy(self.head(out).flatten(0, 1), y.flatten()), hidden

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

The engine calls ``training_step(batch, **kwargs)`` where ``kwargs`` holds only what applies:
``hidden=`` (the previous split's hidden state, None at the first split) when TBPTT is on, and
``optimizer_index=`` when ``configure_optimizers`` returns several optimizers, and, as in
Lightning, ``batch_idx=`` / ``split_idx=`` (0-based, as in the cursor) when the step declares
parameters of those names. With TBPTT the step returns ``(loss, hidden)``; without, it returns
``loss``.

Manual optimization under any ``TrainerConfig.precision``: call ``self.manual_backward(loss)``
and ``self.manual_step(optimizer)`` instead of ``loss.backward()`` / ``optimizer.step()``; with
"16-mixed" they scale the loss and step through the run's gradient scaler (saved in every
checkpoint), otherwise they are the plain calls::

    def training_step(self, batch, hidden):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss, hidden = self.compute(batch, hidden)
        self.manual_backward(loss)
        self.manual_unscale(optimizer)     # only needed before clipping
        torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)
        self.manual_step(optimizer)
        return loss, hidden
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine.data.splitting import Batch, split_along_time
from engine.loops.precision import Precision
from engine.errors import ModuleContractError
from engine.loops.optim_setup import OptimizerSetup
from engine.loops.logged import MetricLogger, Reduce


class Module(torch.nn.Module):
    """Base class for modules trained by :class:`engine.Trainer`.

    Class attributes (override in the subclass or set in ``__init__``):
        tbptt_split_length: split length in time steps; None turns TBPTT off.
        tbptt_time_dim: the dimension of each tensor that is time (default 1, batch-first).
        carry_hidden_across_batches: keep the hidden state from one batch to the next within an
            epoch (one long sequence cut into windows); by default it resets at each batch.
            It always resets at the start of an epoch.
        automatic_optimization: False hands backward and ``optimizer.step()`` to the step
            (manual optimization); the engine still counts the steps.
    """

    tbptt_split_length: int | None = None
    tbptt_time_dim: int = 1
    carry_hidden_across_batches: bool = False
    automatic_optimization: bool = True

    def __init__(self) -> None:
        super().__init__()
        self._engine_optimizers: list[torch.optim.Optimizer] = []
        self._engine_schedulers: list[object] = []
        self._engine_precision: Precision = Precision()
        self._engine_logger: MetricLogger | None = None

    def training_step(self, batch: Batch, **kwargs: object) -> object:  # pragma: no cover - abstract
        """Compute the loss of one batch (or TBPTT split). See the module docstring."""
        raise NotImplementedError(f"{type(self).__name__} must implement training_step")

    def configure_model(self) -> None:
        """Called once the process group and the device exist, before ``configure_optimizers``:
        the place to shard the model (``torch.distributed.fsdp.fully_shard`` on its layers and
        itself, see docs/distributed.md). The default does nothing."""

    def configure_optimizers(self) -> object:  # pragma: no cover - abstract
        """Return an optimizer, a list of optimizers, or a dict
        ``{"optimizers": [...], "schedulers": [scheduler or engine.LRSchedule, ...]}``."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure_optimizers")

    # validation_step(batch) -> loss | dict | None, or with TBPTT validation_step(batch, hidden)
    # -> (loss | dict | None, hidden): define it to use ``val_data`` (see docs/quickstart.md).

    def log(self, name: str, value: torch.Tensor | float, reduce: Reduce = "mean", sync: bool = False) -> None:
        """Log a scalar from ``training_step`` or ``validation_step``.

        Training values become the split's row in metrics.jsonl (reduced within the split) and
        are aggregated over the epoch with ``reduce`` ("mean", "sum", "max", "min", "last");
        validation values are aggregated over the validation pass. The newest value of each
        name is in ``FitResult.metrics`` and ``RunView.metrics``, and can be monitored by
        ``CheckpointConfig(monitor=...)`` and :class:`engine.EarlyStopping`.

        Under torchrun, ``sync=True`` reduces a training value across the ranks at the split's
        end (``reduce`` over every rank's values, combined in rank order: the same bits on
        every rank and every rerun); without it each rank keeps its own value and rank 0's is
        written. Validation values are always reduced across ranks. In a single process
        ``sync`` changes nothing. See docs/distributed.md.
        """
        logger = self._engine_logger
        if logger is None:
            raise ModuleContractError(f"{type(self).__name__}.log({name!r}) is available only while Trainer.fit runs")
        logger.log(name, value, reduce, sync=sync)

    def split_batch(self, batch: Batch, split_length: int) -> Sequence[Batch]:
        """Cut a batch into TBPTT splits. The default cuts every tensor along
        ``tbptt_time_dim``; override for other layouts."""
        return split_along_time(batch, split_length, self.tbptt_time_dim)

    def optimizers(self) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
        """The optimizers of the running fit: one, or a list when there are several."""
        optimizers = self._engine_optimizers
        return optimizers[0] if len(optimizers) == 1 else list(optimizers)

    def lr_schedulers(self) -> list[object]:
        """The LR schedulers of the running fit (for manual optimization, which steps them)."""
        return list(self._engine_schedulers)

    def manual_backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss``, scaled by the run's gradient scaler under "16-mixed"."""
        self._engine_precision.backward(loss)

    def manual_unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the loss scale (before clipping them); a no-op
        without a gradient scaler."""
        self._engine_precision.unscale(optimizer)

    def manual_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` through the gradient scaler under "16-mixed" (skipped when a
        gradient is inf/nan; a skipped step is not counted), then the scale's update."""
        self._engine_precision.step(optimizer)
        self._engine_precision.update()

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The run's gradient scaler under "16-mixed", None otherwise (for full control; the
        engine saves its state in every checkpoint)."""
        return self._engine_precision.scaler


def bind_run(module: torch.nn.Module, setup: OptimizerSetup, logger: MetricLogger) -> None:
    """Make the running fit's optimizers, schedulers and metric logger available to
    ``module.optimizers()``, ``module.lr_schedulers()`` and ``module.log()`` (engine modules
    only; a plain nn.Module is left untouched)."""
    if isinstance(module, Module):
        module._engine_optimizers = list(setup.optimizers)
        module._engine_schedulers = [schedule.scheduler for schedule in setup.schedules]
        module._engine_logger = logger


def bind_precision(module: torch.nn.Module, precision: Precision) -> None:
    """Make the running fit's precision (autocast, gradient scaler) reach
    ``module.manual_backward`` / ``manual_step`` / ``grad_scaler`` (engine modules only)."""
    if isinstance(module, Module):
        module._engine_precision = precision
