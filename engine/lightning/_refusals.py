"""What the adapter does not run, refused before training in one line that names every such
feature at once (never ignored).

A hook is refused only where Lightning would call it: ``fit`` never calls ``predict_step`` or
the test hooks, so a module that defines them trains; :meth:`engine.lightning.Trainer.test`
calls the test hooks it can honour and refuses the others.
"""

from __future__ import annotations

from typing import Callable, Iterable

from engine.config import TrainerConfig
from engine.errors import ConfigError, EngineError, ModuleContractError
from engine.lightning._logging import TEST, VALIDATION
from engine.lightning._packages import overrides

# LightningModule hooks that Lightning's fit calls and the engine's loops have no place for, and
# why (or what to use instead).
UNSUPPORTED_FIT_HOOKS = {
    "optimizer_step": "the engine steps the optimizers itself; use manual optimization to step them your way",
    "optimizer_zero_grad": "the engine zeroes gradients itself",
    "backward": "the engine runs backward itself; use manual optimization",
    "on_before_backward": "no engine hook there",
    "on_after_backward": "no engine hook there; inspect gradients in on_before_optimizer_step",
    "on_before_zero_grad": "no engine hook there",
    "configure_gradient_clipping": "use TrainerConfig(gradient_clip_val=..., gradient_clip_algorithm=...)",
    "lr_scheduler_step": "the engine steps schedulers itself; return them from configure_optimizers",
    "configure_model": "build the layers in __init__",
    "configure_sharded_model": "build the layers in __init__",
    "transfer_batch_to_device": "the engine moves batches to TrainerConfig.device itself",
    "on_before_batch_transfer": "transform batches in the dataset or collate_fn",
    "on_after_batch_transfer": "transform batches in the dataset or collate_fn",
    "on_validation_model_eval": "the engine puts the module in eval mode itself",
    "on_validation_model_train": "the engine restores the training mode itself",
    "on_validation_model_zero_grad": "the engine keeps pending gradients through validation",
    "training_epoch_end": "removed in Lightning 2.0; use on_train_epoch_end",
    "validation_epoch_end": "removed in Lightning 2.0; use on_validation_epoch_end",
    "test_epoch_end": "removed in Lightning 2.0; use on_test_epoch_end",
    "training_step_end": "removed in Lightning 2.0; finish the step in training_step",
    "validation_step_end": "removed in Lightning 2.0; finish the step in validation_step",
}

# What Lightning's validate() and test() call and engine.lightning.Trainer's do not, by stage.
_EVALUATION_HOOKS = {
    "transfer_batch_to_device": "the adapter moves batches to the module's device itself",
    "on_before_batch_transfer": "transform batches in the dataset or collate_fn",
    "on_after_batch_transfer": "transform batches in the dataset or collate_fn",
    "configure_model": "build the layers in __init__",
}
UNSUPPORTED_EVALUATION_HOOKS = {
    VALIDATION: {**_EVALUATION_HOOKS,
                 "on_validation_model_eval": "the adapter puts the module in eval mode itself",
                 "on_validation_model_train": "the adapter restores the training mode itself",
                 "validation_epoch_end": "removed in Lightning 2.0; use on_validation_epoch_end",
                 "validation_step_end": "removed in Lightning 2.0; finish the step in validation_step"},
    TEST: {**_EVALUATION_HOOKS,
           "on_test_model_eval": "the adapter puts the module in eval mode itself",
           "on_test_model_train": "the adapter restores the training mode itself",
           "test_epoch_end": "removed in Lightning 2.0; use on_test_epoch_end"},
}


def unsupported_hooks(model: object, hooks: dict[str, str]) -> list[str]:
    """One sentence per hook of ``hooks`` the user's class overrides."""
    return [f"{type(model).__name__}.{name}: not supported by engine.lightning ({remedy})"
            for name, remedy in hooks.items() if overrides(model, name)]


def refuse_unsupported_hooks(model: object, hooks: dict[str, str] = UNSUPPORTED_FIT_HOOKS) -> None:
    """Refuse a module that overrides hooks the adapter cannot call at their place, naming all."""
    reasons = unsupported_hooks(model, hooks)
    if reasons:
        raise ModuleContractError("; ".join(reasons))


def refuse_unsupported_config(config: TrainerConfig, model: object) -> None:
    """Manual optimization under "16-mixed" needs the engine's manual_step, which Lightning code does not call."""
    if config.precision == "16-mixed" and not getattr(model, "automatic_optimization", True):
        raise ConfigError("TrainerConfig.precision='16-mixed' with manual optimization: not supported by "
                          "engine.lightning (optimizer.step() would bypass the gradient scaler); use '32' or 'bf16-mixed'")


def refuse_together(checks: Iterable[Callable[[], object]]) -> None:
    """Run every check; the refusals they raise come back as one error of the first one's type,
    their messages joined in one line, so a user fixes them all in one go."""
    refusals: list[EngineError] = []
    for check in checks:
        try:
            check()
        except (ConfigError, ModuleContractError) as refusal:
            refusals.append(refusal)
    if len(refusals) == 1:
        raise refusals[0]
    if refusals:
        raise type(refusals[0])("; ".join(str(refusal) for refusal in refusals))
