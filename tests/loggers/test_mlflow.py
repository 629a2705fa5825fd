"""engine.loggers.MLflow against a real MLflow tracking server (tests/mlflow_server.py: MLflow's
tracking app over SQLite on 127.0.0.1): the MLflow run holds exactly the rows of metrics.jsonl,
each once; a run SIGKILLed and resumed is one MLflow run whose metric histories (read back with
MlflowClient.get_metric_history) equal an uninterrupted run's, params logged once; a stopped
server costs one warning and the rows arrive once it is back, or are listed as unsent."""

from __future__ import annotations

import json
import pathlib
import random
import warnings
from typing import Callable

import pytest
import torch

import engine
import engine.loggers
from kill_helpers import kill_at_random_instant, run_scenario
from mlflow_server import MlflowTestServer, mlflow_server  # noqa: F401  (fixture)
from plateau_scenario import train_plateau
from resume_helpers import assert_same_run, read_metrics
from tracker_histories import History, expected_histories, kill_once

SCRIPT = str(pathlib.Path(__file__).parent.parent / "plateau_scenario.py")


def mlflow_runs(server: MlflowTestServer, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.uri)
    found = client.get_experiment_by_name(experiment)
    return [] if found is None else list(client.search_runs([found.experiment_id]))


def histories(server: MlflowTestServer, run_id: str) -> History:
    """Every metric of the MLflow run: its points in the order they were logged, as (step, value)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.uri)
    result = {}
    for key in client.get_run(run_id).data.metrics:
        points = sorted(client.get_metric_history(run_id, key), key=lambda metric: metric.timestamp)
        result[key] = [(metric.step, metric.value) for metric in points]
    return result


def the_one_run(server: MlflowTestServer, experiment: str, run_dir: str):
    runs = mlflow_runs(server, experiment)
    assert len(runs) == 1, [run.info.run_id for run in runs]
    assert json.loads(pathlib.Path(run_dir, "mlflow-run.json").read_text())["run_id"] == runs[0].info.run_id
    return runs[0]


def assert_same_params(run, reference_run) -> None:
    """The params of ``run`` are the reference's (each run names its own run_dir)."""
    def without_run_dir(params):
        return {key: value for key, value in params.items() if key != "config/run_dir"}

    assert without_run_dir(run.data.params) == without_run_dir(reference_run.data.params)


@pytest.fixture(scope="module")
def reference(mlflow_server, tmp_path_factory):
    """The plateau scenario (TBPTT, validation, learning rate reduced on plateaus) run once,
    uninterrupted, with the MLflow logger."""
    run_dir, experiment = str(tmp_path_factory.mktemp("reference")), mlflow_server.experiment()
    logger = engine.loggers.MLflow(mlflow_server.uri, experiment=experiment)
    train_plateau(run_dir, loggers=[logger])
    return run_dir, the_one_run(mlflow_server, experiment, run_dir)


def test_the_mlflow_run_holds_exactly_the_rows_of_metrics_jsonl_and_the_params(mlflow_server, reference):
    run_dir, run = reference
    assert histories(mlflow_server, run.info.run_id) == expected_histories(run_dir)
    assert run.info.status == "FINISHED"
    assert run.data.params["config/max_epochs"] == "3" and run.data.params["config/val_every_n_steps"] == "5"
    assert not any(key.startswith("config/loggers") for key in run.data.params)


def holds_train_losses(server: MlflowTestServer, experiment: str, points: int) -> Callable[[], bool]:
    """Whether the experiment's MLflow run holds ``points`` train/loss points (rows a checkpoint
    committed and the sender sent; more may be committed and unsent)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.uri)

    def holds() -> bool:
        runs = mlflow_runs(server, experiment)
        return bool(runs) and len(client.get_metric_history(runs[0].info.run_id, "train/loss")) >= points

    return holds


@pytest.mark.exhaustive  # CI time (about 30 s: the default run keeps the MLflow rows test and the tracker kills of tests/loggers on the shared machinery)
@pytest.mark.slow
def test_a_run_killed_after_rows_reached_mlflow_resumes_into_the_same_run_each_point_once(mlflow_server, reference,
                                                                                       tmp_path):
    reference_dir, reference_run = reference
    run_dir, experiment = str(tmp_path / "run"), mlflow_server.experiment()
    kill_once(SCRIPT, run_dir, ["--mlflow", mlflow_server.uri, experiment],
              holds_train_losses(mlflow_server, experiment, points=8))
    process = run_scenario("schedule", run_dir, None, "--mlflow", mlflow_server.uri, experiment, script=SCRIPT)
    assert process.returncode == 0, process.stderr[-3000:]
    assert_same_run(reference_dir, run_dir)
    run = the_one_run(mlflow_server, experiment, run_dir)
    assert histories(mlflow_server, run.info.run_id) == histories(mlflow_server, reference_run.info.run_id)
    assert_same_params(run, reference_run)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_sigkill_at_random_instants(mlflow_server, reference, tmp_path):
    reference_dir, reference_run = reference
    rng = random.Random(36)
    run_dir, experiment = str(tmp_path / "run"), mlflow_server.experiment()
    kills = 0
    for _ in range(8):
        # Kills within the first second of training, of a run of a few seconds: several land before it ends.
        if not kill_at_random_instant("schedule", run_dir, rng, 1.0, "--sleep", "0.1", "--mlflow", mlflow_server.uri,
                                      experiment, script=SCRIPT):
            break
        kills += 1
    process = run_scenario("schedule", run_dir, None, "--mlflow", mlflow_server.uri, experiment, script=SCRIPT)
    assert process.returncode == 0, process.stderr[-3000:]
    assert kills >= 3
    assert_same_run(reference_dir, run_dir)
    run = the_one_run(mlflow_server, experiment, run_dir)
    assert histories(mlflow_server, run.info.run_id) == histories(mlflow_server, reference_run.info.run_id)
    assert_same_params(run, reference_run)


class ServerOutage(engine.Callback):
    """Stops the tracking server after split ``down_at`` and starts it again after split
    ``up_at`` (never, if None), counted in this process."""

    def __init__(self, server: MlflowTestServer, down_at: int, up_at: int | None) -> None:
        self.server, self.down_at, self.up_at, self.splits = server, down_at, up_at, 0

    def on_split_end(self, view: engine.RunView) -> None:
        self.splits += 1
        if self.splits == self.down_at:
            self.server.stop()
        elif self.splits == self.up_at:
            self.server.start()


def tracker_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(warning.message) for warning in caught if "engine.loggers.MLflow" in str(warning.message)]


def test_a_stopped_server_costs_one_warning_and_gets_every_row_once_it_is_back(mlflow_server, reference, tmp_path):
    reference_dir, reference_run = reference
    run_dir, experiment = str(tmp_path / "run"), mlflow_server.experiment()
    logger = engine.loggers.MLflow(mlflow_server.uri, experiment=experiment, retry_seconds=0.1)
    outage = ServerOutage(mlflow_server, down_at=8, up_at=20)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_plateau(run_dir, loggers=[logger], callbacks=(outage,))
    finally:
        if outage.splits < outage.up_at:
            mlflow_server.start()
    assert outage.splits > outage.up_at
    messages = tracker_warnings(caught)
    assert len(messages) == 1 and "cannot reach the tracker" in messages[0] and "training goes on" in messages[0]
    assert_same_run(reference_dir, run_dir)
    run = the_one_run(mlflow_server, experiment, run_dir)
    assert histories(mlflow_server, run.info.run_id) == histories(mlflow_server, reference_run.info.run_id)


def test_rows_still_unsent_at_the_end_are_listed_and_the_next_resume_sends_them(mlflow_server, reference, tmp_path):
    reference_dir, reference_run = reference
    run_dir, experiment = str(tmp_path / "run"), mlflow_server.experiment()
    logger = engine.loggers.MLflow(mlflow_server.uri, experiment=experiment, retry_seconds=0.1, close_timeout=0.5)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_plateau(run_dir, loggers=[logger], callbacks=(ServerOutage(mlflow_server, 30, None),))
    finally:
        mlflow_server.start()
    messages = tracker_warnings(caught)
    assert len(messages) == 2 and "cannot reach the tracker" in messages[0], messages
    rows = len(read_metrics(run_dir).splitlines())
    assert f"{len(logger.unsent)} committed rows (steps" in messages[1] and 0 < len(logger.unsent) < rows
    assert "the next resume of this run sends them" in messages[1]
    assert_same_run(reference_dir, run_dir)  # training and its checkpoints went on regardless
    train_plateau(run_dir, loggers=[logger])  # the finished run, resumed: nothing to train
    run = the_one_run(mlflow_server, experiment, run_dir)
    assert histories(mlflow_server, run.info.run_id) == histories(mlflow_server, reference_run.info.run_id)


@pytest.mark.parametrize("make, message", [
    (lambda: engine.loggers.MLflow(""), "MLflow.tracking_uri: expected a URI string or None, got ''"),
    (lambda: engine.loggers.MLflow(experiment=""), "MLflow.experiment: expected a non-empty experiment name"),
    (lambda: engine.loggers.MLflow(tags={1: "a"}), "MLflow.tags: expected a mapping of str to str"),
    (lambda: engine.loggers.MLflow(close_timeout=0), "MLflow.close_timeout: expected a positive number of seconds"),
])
def test_settings_are_checked_up_front(make, message):
    with pytest.raises(engine.ConfigError, match=message):
        make()


def test_log_model_logs_the_weights_of_the_last_checkpoint_as_an_artifact(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    run_dir, experiment = str(tmp_path / "run"), mlflow_server.experiment()
    model, _ = train_plateau(run_dir, loggers=[engine.loggers.MLflow(mlflow_server.uri, experiment=experiment,
                                                                     log_model=True)], max_epochs=1)
    run = the_one_run(mlflow_server, experiment, run_dir)
    client = MlflowClient(mlflow_server.uri)
    assert [entry.path for entry in client.list_artifacts(run.info.run_id, "model")] == ["model/model.safetensors"]
    weights = load_file(client.download_artifacts(run.info.run_id, "model/model.safetensors", str(tmp_path)))
    trained = model.state_dict()
    assert weights.keys() == trained.keys() and all(torch.equal(weights[key], trained[key]) for key in trained)
