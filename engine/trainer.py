"""The entry point: ``Trainer(config).fit(module, train_data)``."""

from __future__ import annotations

import collections.abc
import dataclasses
import sys
from typing import Any, Iterable, NoReturn, Sequence

import torch

from engine import faults
from engine.callbacks import Callback
from engine.callbacks.hook_names import refuse_misnamed_hooks
from engine.config import TrainerConfig
from engine.data.combined import combine_loaders
from engine.data.checks import check_batch_source, check_reiterable, check_val_data
from engine.distributed.preemption_marker import committed_preemption, preempted_exit_status
from engine.errors import ConfigError
from engine.faults.faulty_fs import filesystem_for
from engine.run.module_checks import check_module
from engine.run.run import FitRun
from engine.run.run_dir import check_local_tier, check_run_dir
from engine.result import FitResult
from engine.unknown_keywords import LIGHTNING_FIT, from_lightning, refuse_keywords, refuse_unknown_keywords, trainer_hints
from engine.checkpoint.store.storage import Storage
from engine.watchdog import watch


class Trainer:
    """Trains an :class:`engine.Module` with exact, split-level resume.

    Example::

        trainer = engine.Trainer(engine.TrainerConfig(max_epochs=3, run_dir="runs/lm"))
        result = trainer.fit(CharLM(), loader)      # resumes from runs/lm if it holds checkpoints

    What ``fit`` does, in loop pseudocode (engine/run/run.py keeps each boundary's order)::

        take the writer lease; restore the newest valid checkpoint; on_fit_start
        for epoch in epochs:                  # FitLoop (until max_epochs)
            for batch in data:                # EpochLoop
                for split in split(batch):    # SplitLoop (TBPTT only)
                    for optimizer in opts:    # OptimizerLoop (several optimizers only)
                        loss, hidden = step(split, hidden)  # flow: zero_grad/backward/step
                    # the split boundary (a batch's without TBPTT):
                    metrics row; display; on_split_end
                    validate if val_every_n_steps is due; on_validation_end
                    step-interval monitored schedulers
                    stop checks: max_steps, max_time, a callback's request, a preemption signal
                    checkpoint if the cadence says so, after a validation, or to stop
                    a stop was requested: leave the loops
            close open accumulation windows; step the epoch's schedulers; reset the hidden state
            # the epoch boundary:
            display; the epoch's aggregate row; validate if val_at_epoch_end; on_validation_end
            epoch-interval monitored schedulers; on_epoch_end
            stop checks: max_time, a callback's request, a preemption signal
            checkpoint if at_epoch_end, for a monitored value, or to stop
        the last checkpoint if the last boundary has none; on_fit_end unless a stop was requested
        # a NaN/spiking loss with anomaly=Rollback(): restore a checkpoint, skip the batch, go on
        # an exception: commit the last completed split if it is still exact, then re-raise
    """

    @refuse_unknown_keywords("Trainer", trainer_hints(field.name for field in dataclasses.fields(TrainerConfig)))
    def __init__(self, config: TrainerConfig | None = None, callbacks: Sequence[Callback] = ()) -> None:
        self.config = config if config is not None else TrainerConfig()
        if not isinstance(self.config, TrainerConfig):
            raise ConfigError(f"Trainer: config must be a TrainerConfig, got {type(config).__name__}")
        if isinstance(callbacks, Callback) or not isinstance(callbacks, collections.abc.Iterable):
            raise ConfigError(f"Trainer: callbacks must be a list of engine.Callback objects, got {callbacks!r}; "
                              "wrap a single callback in a list: callbacks=[callback]")
        for callback in callbacks:
            if not isinstance(callback, Callback):
                raise ConfigError(f"Trainer: callbacks must subclass engine.Callback, got {type(callback).__name__}")
        refuse_misnamed_hooks(callbacks, "Trainer")
        self.callbacks = list(callbacks)

    def fit(self, module: torch.nn.Module, train_data: Iterable[Any], val_data: Iterable[Any] | None = None,
            resume: str = "auto", mode: str | None = None, **unknown: NoReturn) -> FitResult:
        """Train ``module`` on ``train_data`` until a stop condition holds.

        Args:
            module: an :class:`engine.Module` (or any nn.Module with ``training_step`` and
                ``configure_optimizers``).
            train_data: a ``torch.utils.data.DataLoader`` or any re-iterable of batches; or a dict
                of named training loaders, each batch then a dict of one batch per loader
                (``engine.data.combined.CombinedLoaders``, docs/data.md).
            val_data: optional validation batches (re-iterable), run by the module's
                ``validation_step`` at epoch ends and/or every ``val_every_n_steps`` steps
                (see :class:`engine.TrainerConfig`); isolated from training's random streams.
            resume: ``"auto"`` resumes from the newest valid checkpoint in ``run_dir`` when
                there is one and starts fresh otherwise; ``"latest"`` requires one;
                ``"off"`` starts fresh; ``"ckpt-NNNNNNNNNN"`` names a checkpoint.
            mode: with a dict of training loaders, how they combine: ``"max_size_cycle"``
                (the default), ``"min_size"`` or ``"sequential"`` (Lightning's CombinedLoader modes).
            unknown: takes nothing: any other keyword (Lightning's ``ckpt_path``, a misspelt
                ``resum``) raises ConfigError naming what to use; type checkers flag it too.

        Returns:
            a :class:`engine.FitResult`.
        """
        # A catch-all rather than a decorator: warnings raised inside fit point at its caller.
        refuse_keywords("fit", unknown, Trainer.fit, from_lightning(LIGHTNING_FIT))
        if not isinstance(resume, str) or (resume not in ("auto", "latest", "off") and not resume.startswith("ckpt-")):
            raise ConfigError(f"fit: resume must be 'auto', 'latest', 'off' or a checkpoint name ckpt-NNNNNNNNNN, "
                              f"got {resume!r}")
        self.config.validate()  # again: a field may have been changed since the config was built
        check_val_data(val_data, self.config.val_at_epoch_end, self.config.val_every_n_steps)
        faults.arm_from_environment()
        check_module(module)
        train_data = combine_loaders(train_data, mode)
        check_batch_source(train_data)
        check_reiterable(train_data, self.config.max_epochs)
        storage = None
        if self.config.run_dir is not None:
            if self.config.checkpoint is not None and self.config.checkpoint.local_tier is not None:
                check_local_tier(self.config.checkpoint.local_tier, self.config.run_dir)
            check_run_dir(self.config.run_dir)
            storage = Storage(self.config.run_dir, filesystem=filesystem_for(self.config.run_dir))
        self._exit_if_the_launch_was_preempted()
        with watch(self.config.watchdog, storage):
            result = FitRun(self.config, self.callbacks, module, train_data, storage, val_data).run(resume)
        if result.preempted and self.config.exit_on_preemption:
            # One write, newline included: the lines of several ranks under torchrun must not interleave.
            sys.stderr.write(f"splitloop: {result.stop_reason}; checkpoint {result.last_checkpoint} committed at "
                             f"{result.cursor}; exiting with {preempted_exit_status(self.config.preemption_exit_code)}\n")
            sys.stderr.flush()
            raise SystemExit(preempted_exit_status(self.config.preemption_exit_code))
        return result

    def _exit_if_the_launch_was_preempted(self) -> None:
        """A torchrun worker started again after its launch committed a preemption checkpoint
        exits at once, as the preempted workers did: training would only commit again."""
        earlier = committed_preemption()
        if earlier is None or not self.config.exit_on_preemption:
            return
        status = preempted_exit_status(self.config.preemption_exit_code)
        sys.stderr.write(f"splitloop: this launch was already preempted (checkpoint {earlier.get('checkpoint')} "
                         f"committed); a worker started after that does not train; exiting with {status}\n")
        sys.stderr.flush()
        raise SystemExit(status)
