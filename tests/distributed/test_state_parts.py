"""Replicated vs per-rank state: splitting, merging, digests, the world-size check."""

from __future__ import annotations

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
