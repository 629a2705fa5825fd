"""DistributedDataParallel around the user's ``training_step``.

DDP averages gradients across ranks only for a backward that follows *its own* forward. The
engine calls ``training_step``, which calls ``self(...)`` or submodules directly, so wrapping the
module and leaving the step alone would sync nothing. Here DDP wraps a small module whose
``forward`` *is* the step: every step the engine runs is a DDP forward, its backward all-reduces
the gradients (averaged over the ranks), whatever the step calls inside.

Gradient accumulation: a unit whose backward does not step runs under DDP's ``no_sync``
(``require_backward_grad_sync`` set before the forward); the unit that steps syncs the whole
accumulated gradient. A window the end of the data leaves open is averaged explicitly before
its step (:meth:`DataParallelStep.sync_open_window`).

The bucket layout is fixed for the whole process (see ``find_unused_parameters`` below), so a
resumed run reduces every gradient in the same order as the uninterrupted one.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from engine.distributed.environment import DistributedContext


class _StepAsForward(torch.nn.Module):
    """A module whose forward is the user's training step (its parameters are the user's)."""

    def __init__(self, module: torch.nn.Module, step: Callable[..., Any]) -> None:
        super().__init__()
        self.module = module
        self.step = step

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.step(*args, **kwargs)


class DataParallelStep:
    """The step as DDP runs it, and the accumulation hooks the flow calls."""

    def __init__(self, module: torch.nn.Module, step: Callable[..., Any], context: DistributedContext) -> None:
        device_ids = [context.device] if context.device.type == "cuda" else None
        # find_unused_parameters=True keeps DDP's gradient buckets as built here for the whole
        # process: otherwise DDP rebuilds them after its first backward, so a resumed process
        # would reduce one step with another layout than the uninterrupted run, and with three
        # or more ranks the sums would round differently (exact resume would be lost). It also
        # lets a step leave parameters unused (several optimizers, manual optimization).
        self.ddp = DistributedDataParallel(_StepAsForward(module, step), device_ids=device_ids,
                                           find_unused_parameters=True)
        self._world_size = context.world_size

        @functools.wraps(step)  # keeps the step's signature (batch_idx / split_idx detection)
        def run_step(*args: Any, **kwargs: Any) -> Any:
            return self.ddp(*args, **kwargs)

        self.step: Callable[..., Any] = run_step

    def set_will_step(self, will_step: bool) -> None:
        """Before a unit's forward: sync its backward only when an optimizer step follows."""
        self.ddp.require_backward_grad_sync = will_step

    def sync_open_window(self, parameters: list[torch.nn.Parameter]) -> None:
        """Average the gradients of a window that is still open (so every backward since the
        last step ran under ``no_sync``, in this process or before a resume) before its step."""
        for parameter in parameters:
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad)
                parameter.grad.div_(self._world_size)
