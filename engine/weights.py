"""Weights out of a run: load a checkpoint's model state into a module, or export it as a plain
``state_dict`` file.

::

    model = CharLM(vocab=100)
    engine.load_weights(model, "runs/lm")                       # the newest checkpoint that verifies
    engine.load_weights(model, "runs/lm", checkpoint="best")    # the best by CheckpointConfig.monitor
    engine.export_weights("runs/lm", "lm.pt")                   # torch.load("lm.pt", weights_only=True)
    engine.export_weights("runs/lm", "lm.safetensors", format="safetensors")  # needs the safetensors extra

Checkpoints are verified as a resume verifies them (sizes, checksums, the state tree); a module
whose keys, shapes or dtypes differ is refused with the differences named. A checkpoint of a
sharded (FSDP2) run is consolidated here, in this one process with no process group: each tensor
is assembled from every rank's shards by the offsets recorded with them.
"""

from __future__ import annotations

import os
import torch

from engine.distributed.sharded import consolidated_module_state
from engine.errors import ConfigError
from engine.run import state as run_state
from engine.run.weights_file import EXPORT_FORMATS, read_checkpoint, write_weights


def load_weights(module: torch.nn.Module, source: str, checkpoint: str = "latest") -> str:
    """Load the model state of a run's checkpoint into ``module``; returns the checkpoint's name.

    Args:
        module: the model to fill (same architecture as the one trained).
        source: the run directory (a path or fsspec URL).
        checkpoint: ``"latest"`` (the newest that verifies), ``"best"`` (the best kept by
            ``CheckpointConfig(monitor=...)``) or a checkpoint name ``ckpt-NNNNNNNNNN``.
    """
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"load_weights: module must be a torch.nn.Module, got {type(module).__name__}")
    loaded = read_checkpoint(source, checkpoint)
    weights = consolidated_module_state(loaded)
    run_state.check_module_state(loaded.name, module, weights)
    run_state.load_module_state(module, weights)
    return loaded.name


def export_weights(source: str, path: str, checkpoint: str = "latest", format: str = "torch") -> str:
    """Write the model state of a run's checkpoint to ``path``; returns the checkpoint's name.

    ``format="torch"``: a plain ``state_dict`` file (``torch.save``), readable with
    ``torch.load(path, weights_only=True)``. ``format="safetensors"``: a safetensors file
    (``safetensors.torch.load_file``), for inference tools; needs the ``safetensors`` extra."""
    if format not in EXPORT_FORMATS:
        raise ConfigError(f"export_weights: format={format!r}; expected one of {list(EXPORT_FORMATS)}")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"export_weights: path must be a file path, got {path!r}")
    if os.path.isdir(path):
        raise ConfigError(f"export_weights: {path} is a directory; give a file name such as model.pt")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"export_weights: cannot write {path}: its directory {parent} does not exist; create it first")
    loaded = read_checkpoint(source, checkpoint)
    write_weights(loaded, path, format)
    return loaded.name
