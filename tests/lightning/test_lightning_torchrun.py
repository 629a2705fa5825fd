"""engine.lightning.Trainer under a real torchrun (2 ranks, gloo): ``sync_dist=True`` averages a
value over the ranks, a value without it is rank 0's, and ``self.trainer`` names the group."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
REPOSITORY = str(HERE.parents[1])

# A torchrun job costs ~25 s on a loaded 2-core machine: beyond tests/lightning's default budget.
pytestmark = [pytest.mark.slow, pytest.mark.exhaustive]


def test_sync_dist_averages_over_the_ranks_and_the_trainer_names_the_group(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "SPLITLOOP_FAULTS"}
    env.update(PYTHONPATH=os.pathsep.join([REPOSITORY, str(HERE), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--monitor-interval=0.2", str(HERE / "lit_torchrun.py"), str(tmp_path / "run")]
    process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert process.returncode == 0, process.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (epoch,) = [row for row in rows if row.get("stage") == "train_epoch"]
    logged = {name: epoch["metrics"][name] for name in ("rank_synced", "rank_plain", "world_size", "global_zero")}
    assert logged == {"rank_synced": 0.5, "rank_plain": 0.0, "world_size": 2.0, "global_zero": 1.0}
