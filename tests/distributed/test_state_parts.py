"""Replicated vs per-rank state: splitting, merging, digests, the world-size check."""

from __future__ import annotations

import enum

import crc32c
import pytest
import torch

from engine.distributed import state_parts
from engine.errors import CheckpointCorrupt, CheckpointIncompatible


def _state(bias: float = 0.0, rng: int = 1) -> dict:
    return {"signature": {"world_size": 2}, "module": {"w": torch.ones(3), "b": torch.tensor([bias])},
            "optimizers": [{"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 0.1}]}],
            "schedulers": [], "loops": {"split": {"hidden": torch.full((2,), float(rng))}}, "rng": {"seed": rng},
            "callbacks": {}, "metrics_bytes": 10, "elapsed_seconds": 1.0, "envelope": {}}


def test_a_rank_takes_its_own_part_back_and_keeps_the_replicated_state() -> None:
    main, other = _state(rng=1), _state(rng=2)
    merged = state_parts.with_rank_part("ckpt-0000000001", main, state_parts.rank_part(other))
    assert merged["rng"] == {"seed": 2} and torch.equal(merged["loops"]["split"]["hidden"], torch.full((2,), 2.0))
    assert merged["module"] is main["module"] and merged["metrics_bytes"] == 10


def test_a_rank_part_with_other_keys_is_corrupt() -> None:
    with pytest.raises(CheckpointCorrupt, match="a rank part has keys"):
        state_parts.with_rank_part("ckpt-0000000001", _state(), {"rng": {}})


def test_digests_differ_only_where_the_replicated_state_differs() -> None:
    same = state_parts.replicated_digest(_state(rng=1), b"progress")
    assert same == state_parts.replicated_digest(_state(rng=2), b"progress")  # per-rank parts do not count
    drifted = state_parts.replicated_digest(_state(bias=1e-3), b"progress")
    assert state_parts.differences([same, same, drifted]) == ["module.b (rank(s) [2] differ from rank 0)"]
    moved = state_parts.replicated_digest(_state(), b"other progress")
    assert state_parts.differences([same, moved]) == ["progress (rank(s) [1] differ from rank 0)"]


def test_a_digest_covers_each_tensors_dtype_and_shape_beside_its_bytes() -> None:
    """Tensors of the same bytes (16 zero bytes) but another dtype or shape digest differently,
    however often each was digested before (a tensor's dtype and shape are encoded once)."""
    def digest(tensor: torch.Tensor) -> dict:
        state = _state()
        state["module"]["w"] = tensor
        return state_parts.replicated_digest(state, b"progress")

    tensors = [torch.zeros(4), torch.zeros(2, 2), torch.zeros(4, dtype=torch.int32), torch.zeros(1, 4),
               torch.zeros(8, dtype=torch.float16)]
    for _ in range(2):
        digests = [digest(tensor)["module.w"] for tensor in tensors]
        assert len(set(digests)) == len(tensors)
        assert digest(torch.zeros(2, 2))["module.w"] == digests[1]
        assert digest(torch.zeros(4).reshape(2, 2).t())["module.w"] == digests[1]  # not contiguous: its values


def _reference_crc(value, crc: int = 0) -> int:
    """The digest's definition, one call per value (what the engine computes with fewer calls)."""
    if isinstance(value, torch.Tensor):
        plain = value.detach().to("cpu").contiguous().reshape(-1)
        crc = crc32c.crc32c(str((plain.dtype, tuple(value.shape))).encode(), crc)
        return crc32c.crc32c(plain.view(torch.uint8).numpy().tobytes(), crc)
    if isinstance(value, dict):
        for key in sorted(value, key=repr):
            crc = _reference_crc(value[key], crc32c.crc32c(repr(key).encode(), crc))
        return crc
    if isinstance(value, (list, tuple)):
        for item in value:
            crc = _reference_crc(item, crc)
        return crc
    return crc32c.crc32c(repr(value).encode(), crc)


class _Level(enum.IntEnum):
    LOW = 1


def test_digests_follow_their_definition_for_every_kind_of_value() -> None:
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    optimizer = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": weights.t(), "flag": True},
                           1: {"momentum_buffer": torch.zeros(0), "level": _Level.LOW}},
                 "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1], "name": "all", "none": None,
                                   "raw": b"\x00\x01", "big": 2**70, "nested": [{"x": 1.5}, (2, [3.0])]}]}
    state = {"module": {"w": weights, "b": torch.ones(4, requires_grad=True), "h": torch.zeros(2, dtype=torch.bfloat16),
                        "p": torch.nn.Parameter(torch.ones(2))},
             "optimizers": [optimizer], "schedulers": [{"last_epoch": 3, "_step_count": 4, "base_lrs": [0.1]}]}
    digest = state_parts.replicated_digest(state, b"progress")
    assert digest == {"progress": crc32c.crc32c(b"progress"),
                      **{f"module.{key}": _reference_crc(value) for key, value in state["module"].items()},
                      "optimizers[0]": _reference_crc(optimizer), "schedulers[0]": _reference_crc(state["schedulers"][0])}


def test_a_different_world_size_is_refused_naming_both() -> None:
    state_parts.check_world_size("ckpt-0000000003", {"world_size": 2}, 2)
    with pytest.raises(CheckpointIncompatible, match="written with world size 2 and this run has world size 3"):
        state_parts.check_world_size("ckpt-0000000003", {"world_size": 2}, 3)
    with pytest.raises(CheckpointIncompatible, match="world size 1 and this run has world size 2"):
        state_parts.check_world_size("ckpt-0000000003", {}, 2)


def test_rank_file_names() -> None:
    assert state_parts.rank_files(3) == ("rank-00003.bin", "rank-00003.msgpack")
    assert state_parts.is_rank_file("rank-00003.bin") and not state_parts.is_rank_file("rank-3.bin")
    assert not state_parts.is_rank_file("../rank-00003.bin")
