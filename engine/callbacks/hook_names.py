"""A method of an engine.Callback named like a hook the engine never calls (a Lightning hook
name, or a near miss of an engine hook's) would be skipped silently: refuse it when the
trainer is built, naming the engine hook it most likely means."""

from __future__ import annotations

import difflib
from typing import Iterable

from engine.callbacks import Callback
from engine.errors import ConfigError

ENGINE_HOOKS = tuple(name for name in vars(Callback) if name.startswith("on_"))

# Lightning Callback hooks, and the engine hook called at (or nearest to) their place.
LIGHTNING_HOOKS = {
    "on_train_start": "on_fit_start", "on_train_end": "on_fit_end",
    "on_train_epoch_start": "on_epoch_end", "on_train_epoch_end": "on_epoch_end",
    "on_train_batch_start": "on_split_end", "on_train_batch_end": "on_split_end",
    "on_before_backward": "on_split_end", "on_after_backward": "on_split_end",
    "on_before_optimizer_step": "on_split_end", "on_before_zero_grad": "on_split_end",
    "on_validation_start": "on_validation_end", "on_validation_end": "on_validation_end",
    "on_validation_epoch_start": "on_validation_end", "on_validation_epoch_end": "on_validation_end",
    "on_validation_batch_start": "on_validation_end", "on_validation_batch_end": "on_validation_end",
    "on_save_checkpoint": "state_dict", "on_load_checkpoint": "load_state_dict",
    "on_exception": "on_fit_end (called when fit returns normally; an exception propagates to your code)",
}


def likely_meant(name: str) -> str | None:
    """The engine hook a method called ``name`` most likely means, or None if it does not look like a hook."""
    if name in ENGINE_HOOKS or not name.startswith("on_"):
        return None
    if name in LIGHTNING_HOOKS:
        return LIGHTNING_HOOKS[name]
    close = difflib.get_close_matches(name, ENGINE_HOOKS, n=1, cutoff=0.8)
    return close[0] if close else None


def refuse_misnamed_hooks(callbacks: Iterable[Callback], where: str) -> None:
    """ConfigError naming every method of ``callbacks`` that looks like a hook but is none, with
    the hook it most likely means."""
    reasons = []
    for callback in callbacks:
        own = [name for klass in type(callback).__mro__ if klass not in (Callback, object) for name in vars(klass)]
        for name in dict.fromkeys(own):
            meant = likely_meant(name)
            if meant is not None:
                reasons.append(f"{type(callback).__name__}.{name} is not an engine.Callback hook and would never be "
                               f"called; did you mean {meant}?")
    if reasons:
        raise ConfigError(f"{where}: " + "; ".join(reasons) + f" (the hooks: {', '.join(ENGINE_HOOKS)}, "
                          "state_dict, load_state_dict)")
