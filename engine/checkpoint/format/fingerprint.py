"""A sha256 over a model's parameters and buffers and its optimizers' state, in canonical order.

Two runs agree on the fingerprint exactly when those tensors are bit-identical (and the
optimizers' plain settings are equal). Of a sharded checkpoint's state (as ``inspect`` reads it),
the fingerprint covers rank 0's shards and their placements.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Mapping

import torch

from engine.checkpoint.format.shards import TensorShard
from engine.checkpoint.format.tensor_bytes import tensor_bytes_view


def fingerprint(module_state: Mapping[str, torch.Tensor | TensorShard], optimizer_states: Iterable[dict[str, Any]]) -> str:
    """Hex sha256 of ``module.state_dict()`` and ``[optimizer.state_dict(), ...]``."""
    digest = hashlib.sha256()
    for key in sorted(module_state):
        _add_tensor(digest, f"module/{key}", module_state[key])
    for index, optimizer_state in enumerate(optimizer_states):
        groups = optimizer_state.get("param_groups", [])
        digest.update(json.dumps(groups, sort_keys=True, default=repr).encode())
        per_parameter = optimizer_state.get("state", {})
        for parameter_id in sorted(per_parameter):
            for name in sorted(per_parameter[parameter_id]):
                value = per_parameter[parameter_id][name]
                label = f"optimizer{index}/{parameter_id}/{name}"
                if isinstance(value, (torch.Tensor, TensorShard)):
                    _add_tensor(digest, label, value)
                else:
                    digest.update(f"{label}={value!r}".encode())
    return digest.hexdigest()


def _add_tensor(digest: Any, label: str, tensor: torch.Tensor | TensorShard) -> None:
    if isinstance(tensor, TensorShard):
        digest.update(f"{label}:shard:{json.dumps(tensor.placement(), sort_keys=True)}".encode())
        tensor = tensor.local
    tensor = tensor.detach().cpu().contiguous()
    digest.update(f"{label}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
    if tensor.numel():
        digest.update(tensor_bytes_view(tensor).tobytes())
