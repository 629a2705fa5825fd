"""Which parts of the run state are replicated and which belong to one rank.

* **Replicated** (identical on every rank, written once by rank 0 in the checkpoint's main
  files): the module, the optimizers, the schedulers and the progress counters.
* **Per rank** (saved by each rank under its own files ``rank-NNNNN.*``, restored to that same
  rank): every RNG stream, the loop states (the data position and sampler state of the rank's
  shard, the TBPTT hidden state, accumulated gradients of an open window, logged aggregates)
  and the callbacks' states. Rank 0's per-rank part is the one in the main files, so a
  checkpoint of a distributed run is a single-process checkpoint plus one part per other rank.

* **Sharded** (a run whose parameters are FSDP2 DTensors, marked ``sharded`` in its signature):
  the module and the optimizers differ between ranks too (each rank holds its shards), so they
  join the per-rank keys; every rank writes its own shards with their placement
  (engine.checkpoint.format.shards) and nothing is gathered to one rank.

A rank's state tree at resume is the main tree with its own per-rank keys put back.
:func:`replicated_digest` is the cheap cross-rank check run at every checkpoint: one CRC-32C per
entry of the replicated state, compared by rank 0 before it commits.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import torch

from engine.checkpoint.format.checksum import ALGORITHMS, CRC32C
from engine.checkpoint.format.tensor_bytes import tensor_bytes_view
from engine.checkpoint.format.rank_files import is_rank_file, rank_files  # noqa: F401 (re-exported)
# Declared in the checkpoint package, which checks every part when a checkpoint is chosen.
from engine.checkpoint.format.rank_parts import (RANK_PART_KEYS, SHARDED, SHARDED_PART_KEYS, WORLD_SIZE,  # noqa: F401
                                                 is_sharded, rank_part_keys, saved_world_size, with_rank_part)
from engine.checkpoint.format.shards import is_dtensor
from engine.checkpoint.format.state_keys import MODULE, OPTIMIZERS, SCHEDULERS, SIGNATURE
from engine.errors import CheckpointIncompatible

REPLICATED_KEYS = (MODULE, OPTIMIZERS, SCHEDULERS)
# The digest's checksum: the checkpoints' CRC-32C (the CPU's CRC instruction, about 7x zlib's CRC-32
# here, and it leaves the GIL on large buffers), over every replicated tensor at every checkpoint,
# on the training thread. Digests are only compared between the ranks of one job, never stored.
_crc = ALGORITHMS[CRC32C]


def rank_part(state: Mapping[str, Any]) -> dict[str, Any]:
    """The per-rank keys of a full state tree."""
    return {key: state[key] for key in rank_part_keys(state[SIGNATURE])}


def check_world_size(name: str, signature: Mapping[str, Any], world_size: int) -> None:
    """Refuse to resume a checkpoint written by another number of ranks, naming both."""
    saved = saved_world_size(signature)
    if saved != world_size:
        raise CheckpointIncompatible(
            f"{name} was written with world size {saved} and this run has world size {world_size}: its per-rank "
            "state (RNG streams, data shard positions, hidden states) exists for each of the "
            f"{saved} rank(s) only. Resume with {saved} process(es) in all, or start a new run directory "
            "from its weights (engine.load_weights), or pass resume='off' (see docs/distributed.md)"
        )


def replicated_digest(state: Mapping[str, Any], progress_bytes: bytes) -> dict[str, int]:
    """One CRC-32C per replicated entry (each module tensor, each optimizer and scheduler state,
    the progress counters): equal on every rank of a healthy job."""
    digest: dict[str, int] = {"progress": _crc(progress_bytes)}
    for key, tensor in state[MODULE].items():
        digest[f"module.{key}"] = _crc_of(tensor)
    for key in (OPTIMIZERS, SCHEDULERS):
        for index, item in enumerate(state[key]):
            digest[f"{key}[{index}]"] = _crc_of(item)
    return digest


def _crc_of(value: Any, crc: int = 0) -> int:
    """The digest of ``value`` continued from ``crc``: a tensor's dtype, shape and bytes (a
    DTensor's layout), a dict's entries in the order of their keys' text, each key's text then
    its value, a list's or tuple's items, anything else's text (``repr``)."""
    kind = type(value)
    if kind in _TEXT_LEAVES:
        return _crc(repr(value).encode(), crc)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        return _tensor_crc(value, crc)
    if is_dtensor(value):
        # Each rank holds other shards: only the layout must agree (never gather the values).
        return _crc(str((value.dtype, tuple(value.shape), tuple(value.placements))).encode(), crc)
    if isinstance(value, torch.Tensor):
        return _tensor_crc(value, crc)
    if isinstance(value, dict):
        for key in sorted(value, key=repr):
            item = value[key]
            crc = _crc(repr(key).encode(), crc)
            # A plain leaf's text here, without a call (an optimizer's param_groups are many).
            crc = _crc(repr(item).encode(), crc) if type(item) in _TEXT_LEAVES else _crc_of(item, crc)
        return crc
    if isinstance(value, (list, tuple)):
        for item in value:
            crc = _crc(repr(item).encode(), crc) if type(item) in _TEXT_LEAVES else _crc_of(item, crc)
        return crc
    return _crc(repr(value).encode(), crc)


# Values digested as their text: exactly these types (a subclass, an IntEnum say, takes the
# checks above in order, as every value did).
_TEXT_LEAVES = frozenset((type(None), bool, int, float, str, bytes))


def _tensor_crc(value: torch.Tensor, crc: int) -> int:
    # Read in place where it can be (a CPU tensor laid out contiguously: its bytes from
    # data_ptr(), tensor_bytes_view): a view made per tensor costs microseconds at every checkpoint.
    plain = value if value.is_cpu else value.detach().to("cpu")
    if not plain.is_contiguous():
        plain = plain.detach().contiguous()
    crc = _crc(_tensor_header(plain.dtype, tuple(value.shape)), crc)
    return _crc(tensor_bytes_view(plain), crc)


@functools.lru_cache(maxsize=1024)
def _tensor_header(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """What a tensor's digest covers before its bytes: its dtype and shape, as text (made once
    per dtype and shape: tensors keep theirs from one checkpoint to the next)."""
    return str((dtype, shape)).encode()


def differences(digests: list[dict[str, int]]) -> list[str]:
    """What differs between ranks' replicated digests: ``entry (ranks ...)`` per entry, first
    ones first."""
    reference = digests[0]
    found = []
    for key in sorted(set().union(*digests)):
        ranks = [rank for rank, digest in enumerate(digests) if digest.get(key) != reference.get(key)]
        if ranks:
            found.append(f"{key} (rank(s) {ranks} differ from rank 0)")
    return found
