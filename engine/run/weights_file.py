"""A checkpoint's model weights as a plain file: the verified checkpoint of a run read back
(:func:`read_checkpoint`) and its model state, consolidated from every rank's shards, written as a
``state_dict`` file or a safetensors file (:func:`write_weights`). engine.weights's public
``export_weights`` and ``load_weights`` are built on these; the run uses them to hand its loggers
the final weights (``log_model=``)."""

from __future__ import annotations

import importlib.util
import os

import torch

from engine.checkpoint.store.checkpoint_store import CheckpointStore, LoadedCheckpoint
from engine.checkpoint.store.storage import Storage
from engine.distributed.sharded import consolidated_module_state
from engine.errors import CheckpointNotFound, ConfigError
from engine.run import state as run_state

EXPORT_FORMATS = ("torch", "safetensors")


def write_weights(loaded: LoadedCheckpoint, path: str, format: str) -> None:
    """Write the model state of ``loaded`` to ``path`` (replaced at once: written beside it, renamed)."""
    weights = {key: tensor.detach().cpu().contiguous() for key, tensor in consolidated_module_state(loaded).items()}
    temporary = f"{path}.tmp-{os.getpid()}"
    if format == "safetensors":
        _save_safetensors(weights, temporary)
    else:
        torch.save(weights, temporary)
    os.replace(temporary, path)


def newest_weights_into(source: str, directory: str) -> str:
    """Write the model weights of the newest checkpoint of the run in ``source`` that verifies
    into ``directory``, as ``model.safetensors`` (``model.pt``, a ``state_dict`` file for
    ``torch.load(weights_only=True)``, without the safetensors package); returns the file's path."""
    loaded = read_checkpoint(source, "latest")
    safetensors = importlib.util.find_spec("safetensors") is not None
    path = os.path.join(directory, "model.safetensors" if safetensors else "model.pt")
    write_weights(loaded, path, "safetensors" if safetensors else "torch")
    return path


def _save_safetensors(weights: dict[str, torch.Tensor], path: str) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError as error:
        raise ConfigError("export_weights: format='safetensors' needs the safetensors package: "
                          "pip install 'splitloop[safetensors]' (or pip install safetensors)") from error
    save_file(weights, path)


def read_checkpoint(source: str, checkpoint: str) -> LoadedCheckpoint:
    """The verified checkpoint ``checkpoint`` of the run in ``source``."""
    if not isinstance(source, str) or not source:
        raise ConfigError(f"source must be a run directory path or URL, got {source!r}")
    if not isinstance(checkpoint, str):
        raise ConfigError(f"checkpoint must be 'latest', 'best' or a checkpoint name, got {checkpoint!r}")
    try:
        storage = Storage(source, create=False)
    except ConfigError as error:
        raise CheckpointNotFound(f"{source}: no such run directory") from error
    store = CheckpointStore(storage, create=False)
    if checkpoint == "best":
        best = store.best(1)
        if not best:
            raise CheckpointNotFound(f"{source} holds no best checkpoint that verifies "
                                     "(best checkpoints need CheckpointConfig(monitor=...))")
        return store.load(best[0], run_state.validate)
    if checkpoint == "latest":
        loaded = store.latest(run_state.validate)
        if loaded is None:
            raise CheckpointNotFound(f"{source} holds no checkpoint that verifies")
        return loaded
    return store.load(checkpoint, run_state.validate)
