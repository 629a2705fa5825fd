"""The trackers under a real torchrun (2 gloo ranks, tests/distributed/dist_train.py): rank 1 is
SIGKILLed, then rank 0, torchrun restarts the group each time, and the one tracker run (MLflow:
read back from a real tracking server; W&B: its offline run files) holds each row of
metrics.jsonl once, sent by rank 0 alone (rank 1 never creates a run). Each job starts six rank
processes (three tries): exhaustive; the default suite keeps the single-process kill test of
each tracker (tests/loggers/test_mlflow.py, test_wandb.py)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "distributed"))

import torchrun_helpers as helpers  # noqa: E402
from mlflow_server import MlflowTestServer, mlflow_server  # noqa: E402,F401  (fixture)
from test_mlflow import histories, the_one_run as the_one_mlflow_run  # noqa: E402
from tracker_histories import expected_histories  # noqa: E402
from wandb_files import the_one_run as the_one_wandb_run, wandb_environment  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.exhaustive]
# Rank 1 dies at its 5th split of the first try; rank 0 at its 4th split of the second.
KILLS = "0/1/split_end:5:sigkill;1/0/split_end:4:sigkill"


def train_killed_twice(tmp_path: pathlib.Path, *tracker: str, **env: str) -> pathlib.Path:
    process, run_dir, out_dir = helpers.train(tmp_path, "job", 2, *tracker, "--validate-every", "3",
                                              max_restarts=3, KILLS=KILLS, **env)
    assert process.returncode == 0, process.stderr[-4000:]
    assert helpers.worker_pid(out_dir, 0, restart=2) is not None, "the group was not restarted twice"
    return run_dir


def test_one_mlflow_run_under_torchrun_each_row_once(mlflow_server: MlflowTestServer, tmp_path: pathlib.Path) -> None:
    experiment = mlflow_server.experiment()
    run_dir = train_killed_twice(tmp_path, "--mlflow", mlflow_server.uri, experiment)
    run = the_one_mlflow_run(mlflow_server, experiment, str(run_dir))
    assert histories(mlflow_server, run.info.run_id) == expected_histories(str(run_dir))
    assert run.data.params["config/run_dir"] == str(run_dir)


def test_one_wandb_run_under_torchrun_each_row_once(tmp_path: pathlib.Path) -> None:
    wandb_dir = tmp_path / "wandb"
    run_dir = train_killed_twice(tmp_path, "--wandb", str(wandb_dir), "splitloop-tests",
                                 **wandb_environment(tmp_path / "home"))
    run = the_one_wandb_run(wandb_dir, str(run_dir))
    assert run.histories() == expected_histories(str(run_dir))
    steps = sorted(item["_step"] for item in run.history)
    assert steps == list(range(len((run_dir / "metrics.jsonl").read_text().splitlines())))
    assert run.config()["config/run_dir"] == str(run_dir)
    assert json.loads((run_dir / "wandb-run.json").read_text())["id"] == run.run_id
