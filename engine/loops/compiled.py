"""``torch.compile`` and the engine: what is called, and checkpoint keys without ``_orig_mod.``.

``torch.compile(module)`` returns an ``OptimizedModule`` that compiles ``forward`` only; the
engine calls ``training_step``. Given a module compiled as a whole, the engine compiles the
training step with the same compiler settings (``dynamo_ctx``), so the code it runs each split
(the step, and the forward it calls) is the compiled one, and it keeps the original module for
everything else (optimizers binding, state). A module with compiled *submodules* is an ordinary
module whose submodules' forwards are compiled.

Either way ``state_dict`` keys gain an ``_orig_mod.`` segment; checkpoints store the keys with
it removed (:func:`plain_key`), so a checkpoint written compiled loads uncompiled and the reverse.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

COMPILED_SEGMENT = "_orig_mod."


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` is the ``OptimizedModule`` that ``torch.compile(module)`` returns."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # no compile without it loaded
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def original_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped (``module`` itself when it is not compiled)."""
    while is_compiled(module):
        module = getattr(module, "_orig_mod")
    return module


def training_step_of(module: torch.nn.Module, own: torch.nn.Module | None = None) -> Callable[..., Any]:
    """What the engine calls each split: ``training_step``, compiled with the module's compiler
    settings when the module was compiled as a whole (``own``: :func:`original_module` of it,
    when the caller has it already)."""
    if not is_compiled(module):
        return getattr(module, "training_step")
    step = getattr(own if own is not None else original_module(module), "training_step")
    compile_step = getattr(module, "dynamo_ctx", None)
    return compile_step(step) if callable(compile_step) else step


def plain_key(key: str) -> str:
    """A state_dict key without the segments ``torch.compile`` inserts."""
    return key.replace(COMPILED_SEGMENT, "") if COMPILED_SEGMENT in key else key


def plain_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` under :func:`plain_key` keys."""
    return {plain_key(key): value for key, value in state.items()}


def live_keys(module: torch.nn.Module) -> dict[str, str]:
    """Plain key -> the module's own key, to load a plain checkpoint state into ``module``."""
    return {plain_key(key): key for key in module.state_dict()}
