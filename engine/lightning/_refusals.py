"""What the adapter does not run, refused before training with one line naming it (never ignored)."""

from __future__ import annotations

from engine.config import TrainerConfig
from engine.errors import ConfigError, ModuleContractError
from engine.lightning._packages import is_lightning_class

# LightningModule hooks with no place in the engine's loops, and why (or what to use instead).
UNSUPPORTED_HOOKS = {
    "optimizer_step": "the engine steps the optimizers itself; use manual optimization to step them your way",
    "optimizer_zero_grad": "the engine zeroes gradients itself",
    "backward": "the engine runs backward itself; use manual optimization",
    "on_before_backward": "no engine hook there",
    "on_after_backward": "no engine hook there; inspect gradients in on_before_optimizer_step",
    "on_before_zero_grad": "no engine hook there",
    "configure_gradient_clipping": "use TrainerConfig(gradient_clip_val=..., gradient_clip_algorithm=...)",
    "lr_scheduler_step": "the engine steps schedulers itself; return them from configure_optimizers",
    "configure_callbacks": "pass callbacks to engine.lightning.Trainer(callbacks=[...])",
    "configure_model": "build the layers in __init__",
    "configure_sharded_model": "build the layers in __init__",
    "transfer_batch_to_device": "the engine moves batches to TrainerConfig.device itself",
    "on_before_batch_transfer": "transform batches in the dataset or collate_fn",
    "on_after_batch_transfer": "transform batches in the dataset or collate_fn",
    "on_validation_start": "use on_validation_epoch_start",
    "on_validation_end": "use on_validation_epoch_end",
    "on_validation_batch_start": "no per-batch validation hook",
    "on_validation_batch_end": "no per-batch validation hook",
    "on_validation_model_eval": "the engine puts the module in eval mode itself",
    "on_validation_model_train": "the engine restores the training mode itself",
    "on_test_batch_start": "no per-batch test hook",
    "on_test_batch_end": "no per-batch test hook",
    "on_test_start": "no test-start hook", "on_test_end": "no test-end hook",
    "on_test_epoch_start": "no test-epoch hook", "on_test_epoch_end": "no test-epoch hook",
    "predict_step": "prediction is not supported; call the model under torch.no_grad()",
    "training_epoch_end": "removed in Lightning 2.0; use on_train_epoch_end",
    "validation_epoch_end": "removed in Lightning 2.0; use on_validation_epoch_end",
    "test_epoch_end": "removed in Lightning 2.0",
    "training_step_end": "removed in Lightning 2.0; finish the step in training_step",
    "validation_step_end": "removed in Lightning 2.0; finish the step in validation_step",
}


def refuse_unsupported_hooks(model: object) -> None:
    """Refuse a module that overrides a hook the adapter cannot call at its place."""
    for name, remedy in UNSUPPORTED_HOOKS.items():
        owner = _defining_class(type(model), name)
        if owner is not None and not is_lightning_class(owner):
            raise ModuleContractError(f"{type(model).__name__}.{name}: not supported by engine.lightning ({remedy})")


def _defining_class(cls: type, name: str) -> type | None:
    return next((klass for klass in cls.__mro__ if name in vars(klass)), None)


def refuse_unsupported_config(config: TrainerConfig, model: object) -> None:
    """Manual optimization under "16-mixed" needs the engine's manual_step, which Lightning code does not call."""
    if config.precision == "16-mixed" and not getattr(model, "automatic_optimization", True):
        raise ConfigError("TrainerConfig.precision='16-mixed' with manual optimization: not supported by "
                          "engine.lightning (optimizer.step() would bypass the gradient scaler); use '32' or 'bf16-mixed'")
