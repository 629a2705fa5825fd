"""Keyword arguments the entry points do not take: one ConfigError line instead of Python's
``TypeError: __init__() got an unexpected keyword argument``.

``TrainerConfig``, ``CheckpointConfig``, ``Trainer`` and ``Trainer.fit`` check the names they
are given before anything else. A name PyTorch Lightning uses (``accumulate_grad_batches``,
``accelerator``, ``ckpt_path``, ``save_top_k``...) is answered with what this engine calls it;
any other unknown name with the closest known one (``max_epoch``: did you mean ``max_epochs``?).
ConfigError is a TypeError too, so code that caught Python's error still catches this one.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, Iterable, Mapping, TypeVar

from engine.errors import ConfigError

_Callable = TypeVar("_Callable", bound=Callable[..., Any])
_Class = TypeVar("_Class", bound=type)

# Lightning's Trainer(...) arguments -> TrainerConfig (or elsewhere) in this engine.
LIGHTNING_TRAINER: Mapping[str, str] = {
    "accumulate_grad_batches": "accumulate_grad=N with accumulate_over='batches' ('splits' counts TBPTT splits)",
    "accelerator": "device='cpu', 'cuda', 'cuda:N' or 'auto' (docs/devices.md)",
    "devices": "one process per device, started by torchrun: python -m engine launch -- torchrun "
               "--nproc-per-node=N train.py (docs/distributed.md)",
    "num_nodes": "torchrun --nnodes=N, one torchrun per node (docs/distributed.md)",
    "strategy": "no strategy argument: under torchrun the engine wraps the step in DistributedDataParallel "
                "itself (docs/distributed.md)",
    "default_root_dir": "run_dir='runs/my-run' (checkpoints and metrics.jsonl go there)",
    "enable_checkpointing": "checkpoint=None turns checkpoints off; with run_dir the default policy applies",
    "enable_progress_bar": "progress_bar='off' (or 'auto', 'bar', 'log')",
    "check_val_every_n_epoch": "val_at_epoch_end=True validates after every epoch; val_every_n_steps=N every N "
                               "optimizer steps",
    "val_check_interval": "val_every_n_steps=N (optimizer steps)",
    "log_every_n_steps": "every split is a row of metrics.jsonl; log_every_seconds sets the progress log's interval",
    "logger": "loggers=[engine.loggers.TensorBoard(dir), engine.loggers.CSV(path)] (docs/loggers.md); every "
              "row also goes to run_dir/metrics.jsonl, which python -m engine plot draws",
    "callbacks": "Trainer(config, callbacks=[...])",
    "truncated_bptt_steps": "a Module attribute: tbptt_split_length = N",
    "fast_dev_run": "max_steps=1 with run_dir=None",
    "limit_train_batches": "max_steps=N, or pass a shorter loader",
    "deterministic": "no switch: call torch.use_deterministic_algorithms(True) yourself (docs/guarantees.md)",
}

# Lightning's ModelCheckpoint(...) arguments -> CheckpointConfig (or TrainerConfig).
LIGHTNING_CHECKPOINT: Mapping[str, str] = {
    "dirpath": "TrainerConfig(run_dir=...): checkpoints go to the run directory",
    "filename": "none: checkpoints are named ckpt-NNNNNNNNNN after the split count (docs/checkpoint-format.md)",
    "save_top_k": "keep_best=K with monitor=... (keep_last=N keeps the newest N besides)",
    "save_last": "none needed: the newest checkpoints are always kept (keep_last=N)",
    "every_n_train_steps": "every_n_steps=N",
    "every_n_epochs": "at_epoch_end=True (a checkpoint after every epoch)",
    "train_time_interval": "every_seconds=T",
    "save_on_train_epoch_end": "at_epoch_end=True",
    "save_weights_only": "none: a checkpoint holds the whole training state; engine.export_weights and "
                         "engine.load_weights take the weights out",
}

# Lightning's Trainer.fit(...) arguments -> Trainer.fit here.
LIGHTNING_FIT: Mapping[str, str] = {
    "ckpt_path": "resume='ckpt-NNNNNNNNNN' names a checkpoint of TrainerConfig.run_dir, resume='latest' the "
                 "newest (Lightning's 'last'); the default resume='auto' resumes whenever run_dir holds one",
    "model": "module (the first argument)",
    "train_dataloaders": "train_data (the second argument)",
    "val_dataloaders": "val_data",
    "datamodule": "pass its loaders: fit(module, datamodule.train_dataloader(), datamodule.val_dataloader())",
}


def from_lightning(table: Mapping[str, str]) -> dict[str, str]:
    """Hints for Lightning's names: what each is called here."""
    return {name: f"that is PyTorch Lightning's name; here: {equivalent}" for name, equivalent in table.items()}


def trainer_hints(config_fields: Iterable[str]) -> dict[str, str]:
    """What ``Trainer(name=...)`` should have been: a TrainerConfig field, or Lightning's
    Trainer argument, goes into the TrainerConfig given to Trainer."""
    hints = {name: f"it is a TrainerConfig field: Trainer(TrainerConfig({name}=...))" for name in config_fields}
    for name, equivalent in LIGHTNING_TRAINER.items():
        hints.setdefault(name, f"that is PyTorch Lightning's Trainer argument; here, in TrainerConfig: {equivalent}")
    return hints


def unknown_keyword(owner: str, name: str, known: Iterable[str], hints: Mapping[str, str]) -> ConfigError:
    """The error for ``owner(name=...)``: the hint for ``name`` when there is one, else the
    closest known name (or hinted name), else the list of known names."""
    known = list(known)
    if name in hints:
        return ConfigError(f"{owner}: unknown argument {name!r}; {hints[name]}")
    close = difflib.get_close_matches(name, known, n=1) or difflib.get_close_matches(name, list(hints), n=1)
    if close and close[0] in known:
        return ConfigError(f"{owner}: unknown argument {name!r}; did you mean {close[0]}?")
    if close:
        return ConfigError(f"{owner}: unknown argument {name!r}; did you mean {close[0]}? {hints[close[0]]}")
    return ConfigError(f"{owner}: unknown argument {name!r}; it takes {', '.join(known)}")


def known_keywords(function: Callable[..., Any]) -> list[str]:
    """The names ``function`` takes by keyword (``self`` and a ``**`` catch-all left out)."""
    parameters = inspect.signature(function).parameters.values()
    return [parameter.name for parameter in parameters if parameter.name != "self"
            and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)]


def refuse_keywords(owner: str, unknown: Mapping[str, object], function: Callable[..., Any],
                    hints: Mapping[str, str]) -> None:
    """Raise :func:`unknown_keyword`'s ConfigError for the first of ``unknown``, the keywords a
    ``**unknown: NoReturn`` catch-all of ``function`` received (type checkers flag them too)."""
    if unknown:
        raise unknown_keyword(owner, next(iter(unknown)), known_keywords(function), hints)


def refuse_unknown_keywords(owner: str, hints: Mapping[str, str]) -> Callable[[_Callable], _Callable]:
    """Decorate a function (a method: ``self`` is not a keyword) so that a keyword argument it
    does not take raises :func:`unknown_keyword`'s ConfigError before it runs. The wrapper is
    one more frame between the caller and the function: a function whose warnings point at
    its caller (``stacklevel``) takes a catch-all and :func:`refuse_keywords` instead."""
    def decorate(function: _Callable) -> _Callable:
        known = known_keywords(function)

        @functools.wraps(function)
        def checked(*args: Any, **kwargs: Any) -> Any:
            for name in kwargs:
                if name not in known:
                    raise unknown_keyword(owner, name, known, hints)
            return function(*args, **kwargs)
        return checked  # type: ignore[return-value]
    return decorate


def refuse_unknown_fields(hints: Mapping[str, str]) -> Callable[[_Class], _Class]:
    """Class decorator for a dataclass: its ``__init__`` refuses unknown keyword arguments
    (see :func:`refuse_unknown_keywords`); put it above ``@dataclasses.dataclass``."""
    def decorate(cls: _Class) -> _Class:
        setattr(cls, "__init__", refuse_unknown_keywords(cls.__name__, hints)(vars(cls)["__init__"]))
        return cls
    return decorate
