"""docs/distributed.md's FSDP2 recipe, as printed there (tests/distributed/recipe_train.py takes
it from the page), trained by real torchrun jobs: one epoch on 2 ranks, then the documented
elastic resume on one rank (``torchrun --nproc-per-node 1``), whose ``configure_model`` calls
``dist.get_world_size()``, against the same run continued on 2 ranks."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import pytest
import torch

import torchrun_helpers as helpers

pytestmark = pytest.mark.slow

SCRIPT = str(pathlib.Path(__file__).with_name("recipe_train.py"))


def torchrun(ranks: int, job: pathlib.Path, epochs: int) -> subprocess.CompletedProcess:
    (job / "out").mkdir(parents=True, exist_ok=True)
    command = helpers.torchrun_command(ranks, job / "run", job / "out", str(epochs), script=SCRIPT, forked_ranks=True)
    return helpers.run(command, helpers.environment())


def test_the_documented_recipe_resumes_a_two_rank_run_on_one_rank(tmp_path: pathlib.Path) -> None:
    first = torchrun(2, tmp_path / "two", 1)
    assert first.returncode == 0, first.stderr[-4000:]
    shutil.copytree(tmp_path / "two" / "run", tmp_path / "one" / "run")
    continued, resumed = torchrun(2, tmp_path / "two", 2), torchrun(1, tmp_path / "one", 2)
    assert continued.returncode == 0, continued.stderr[-4000:]
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    row = json.loads((tmp_path / "one" / "run" / "resumes.jsonl").read_text().splitlines()[-1])
    assert (row["world_size_before"], row["world_size"]) == (2, 1)
    expected, got = helpers.final_state(tmp_path / "two" / "out", 0), helpers.final_state(tmp_path / "one" / "out", 0)
    assert set(expected) == set(got) and any(key.endswith(".exp_avg_sq") for key in expected)
    for key, value in expected.items():
        if key.endswith(".step"):
            assert torch.equal(value, got[key]), key
        else:
            helpers.assert_close_after_resharding(value, got[key], key)
