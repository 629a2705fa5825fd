"""Rollback under torchrun: one rank meets a NaN loss (a poisoned sample in its shard); the ranks
agree on it before backward, roll back together to the checkpoint rank 0 chooses, skip the
batch on every rank, and end with finite, equal weights; a rank SIGKILLed between the rollback
and its commit makes torchrun restart the group, which ends bit-identical."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

import torchrun_helpers as helpers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def anomalies(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "anomalies.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollback")
    process, run_dir, out_dir = helpers.train(tmp, "reference", 2, "--poison", "--every", "2")
    assert process.returncode == 0, process.stderr[-4000:]
    return tmp / "reference"


def test_the_ranks_roll_back_together_and_end_with_finite_equal_weights(reference):
    rows = anomalies(reference / "run")
    assert [row["kind"] for row in rows] == ["non-finite loss", "non-finite loss"]  # once per epoch
    assert [row["split"][0] for row in rows] == [0, 1]
    assert all(math.isnan(float(row["value"])) for row in rows)
    finals = [helpers.final_state(reference / "out", rank) for rank in (0, 1)]
    for key in (key for key in finals[0] if key.startswith("param.")):
        assert torch.isfinite(finals[0][key]).all()
        assert torch.equal(finals[0][key], finals[1][key])  # DDP replicas: no rank trained on the NaN


@pytest.mark.exhaustive  # CI time (about 14 s: the default run keeps the ranks rolling back together)
def test_a_rank_killed_between_the_rollback_and_its_commit_resumes_bit_identical(reference, tmp_path):
    process, run_dir, out_dir = helpers.train(tmp_path, "killed", 2, "--poison", "--every", "2", max_restarts=1,
                                              KILLS="0/1/after_rollback:1:sigkill")
    assert process.returncode == 0, process.stderr[-4000:]
    assert helpers.worker_pid(out_dir, 1, restart=1) is not None  # the kill happened: torchrun restarted the group
    for rank in (0, 1):
        expected, got = helpers.final_state(reference / "out", rank), helpers.final_state(tmp_path / "killed" / "out", rank)
        assert set(expected) == set(got)
        for key in expected:
            assert same_bits(expected[key], got[key]), f"rank {rank}: {key} differs"
    assert (run_dir / "metrics.jsonl").read_bytes() == (reference / "run" / "metrics.jsonl").read_bytes()
    assert anomalies(run_dir) == anomalies(reference / "run")


def same_bits(expected: torch.Tensor, got: torch.Tensor) -> bool:
    """torch.equal, where NaN equals NaN at the same places: the hidden state dist_train keeps is
    that of its last step, which was the poisoned one when the poison is a rank's last batch."""
    return torch.equal(expected.isnan(), got.isnan()) and torch.equal(expected.nan_to_num(), got.nan_to_num())
