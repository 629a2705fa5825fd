"""``engine.loggers.MLflow``: the rows of metrics.jsonl in an MLflow tracking run, each committed
row once, one MLflow run per engine run across every resume.

Each row's values are MLflow metrics at the row's optimizer ``step``, keyed ``<stage>/<name>`` as
the TensorBoard logger tags them. A row is sent once a checkpoint committed it, by a sender thread
(engine.loggers._tracker). The MLflow run's id is recorded in the run directory
(``mlflow-run.json``) before anything is logged to it: a token is written first and the run is
created with that token as a tag, so a kill between the creation and the record still finds it.
Every later process of the run attaches to that MLflow run, asks it how many points of each metric
it holds (``get_metric_history``), and sends only the committed rows it lacks. The run's
hyperparameters are logged as params once (on a resume, only those missing).

MLflow draws from Python's global ``random`` (a run's generated name, the jitter between HTTP
retries). Drawn on the sender thread beside the training, that would change the training's own
random stream, and a resumed run would no longer be bit-identical: the modules that draw get a
private generator instead (:func:`_private_random`), once, when the sender first imports mlflow.
"""

from __future__ import annotations

import importlib
import random
import sys
import uuid
from types import ModuleType
from typing import Any, Mapping

from engine.errors import ConfigError
from engine.loggers._tracker import Point, Tracker, read_record, require_package, write_record

_MISSING = ("engine.loggers.MLflow needs the mlflow package, which is not installed: "
            "pip install 'splitloop[mlflow]' (or pip install mlflow-skinny)")
RUN_FILE = "mlflow-run.json"
# The modules that draw from Python's global random while MLflow talks to a server (or a local store).
_DRAWING_MODULES = ("mlflow.utils.name_utils", "mlflow.utils.rest_utils", "mlflow.utils.request_utils",
                    "urllib3.util.retry")
TOKEN_TAG = "splitloop.run_token"
MODEL_ARTIFACT = "model"  # log_model's folder among the run's artifacts
_BATCH_METRICS, _BATCH_PARAMS = 1000, 100  # MLflow's limits for one log_batch


class MLflow(Tracker):
    """Send the run's metrics to an MLflow tracking server (needs ``pip install 'splitloop[mlflow]'``)::

        config = engine.TrainerConfig(run_dir="runs/a", loggers=[
            engine.loggers.MLflow("http://mlflow.example:5000", experiment="lm", run_name="lm-a")])

    Args:
        tracking_uri: the tracking server (or any URI MLflow takes); None: MLflow's default
            (``MLFLOW_TRACKING_URI``).
        experiment: the experiment's name (created if missing).
        run_name: the MLflow run's name (MLflow picks one if None).
        tags: tags set on the MLflow run when it is created.
        log_model: at the end of ``fit``, log the weights of the run's last checkpoint as the
            artifact ``model/model.safetensors`` (``model/model.pt`` without safetensors).
        close_timeout: seconds ``fit``'s end waits for the last rows to reach the server.
        retry_seconds: how often an unreachable server is tried again.
    """

    def __init__(self, tracking_uri: str | None = None, experiment: str = "splitloop", run_name: str | None = None,
                 tags: Mapping[str, str] | None = None, log_model: bool = False, close_timeout: float = 30.0,
                 retry_seconds: float = 5.0) -> None:
        super().__init__(close_timeout, retry_seconds, log_model)
        if tracking_uri is not None and (not isinstance(tracking_uri, str) or not tracking_uri.strip()):
            raise ConfigError(f"MLflow.tracking_uri: expected a URI string or None, got {tracking_uri!r}")
        if not isinstance(experiment, str) or not experiment.strip():
            raise ConfigError(f"MLflow.experiment: expected a non-empty experiment name, got {experiment!r}")
        if run_name is not None and not isinstance(run_name, str):
            raise ConfigError(f"MLflow.run_name: expected a string or None, got {run_name!r}")
        if tags is not None and not (isinstance(tags, Mapping) and all(isinstance(k, str) for k in tags)):
            raise ConfigError(f"MLflow.tags: expected a mapping of str to str, got {tags!r}")
        require_package("mlflow", _MISSING)
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.tags = {key: str(value) for key, value in (tags or {}).items()}
        self.run_id: str | None = None
        self._client: Any = None  # an mlflow.tracking.MlflowClient once connected
        self._record: dict[str, str] | None = None

    def __repr__(self) -> str:
        return f"engine.loggers.MLflow({self.tracking_uri!r}, experiment={self.experiment!r})"

    # ---- the sender thread's calls ----------------------------------------------------------
    def _connect(self, fresh: bool) -> None:
        mlflow = _import_mlflow()
        _private_random()
        client = self._client = mlflow.tracking.MlflowClient(self.tracking_uri)
        if self._record is None:  # once per start: a connection tried again keeps its token
            record = None if fresh else read_record(self.run, RUN_FILE)
            if record is None or "token" not in record:
                record = {"token": uuid.uuid4().hex}
                write_record(self.run, RUN_FILE, record)
            self._record = record
        record = self._record
        run_id = record.get("run_id") or self._run_with_token(client, record["token"])
        if run_id is None:
            experiment = client.get_experiment_by_name(self.experiment)
            experiment_id = experiment.experiment_id if experiment is not None else \
                client.create_experiment(self.experiment)
            run_id = client.create_run(experiment_id, tags={**self.tags, TOKEN_TAG: record["token"]},
                                       run_name=self.run_name).info.run_id
        if record.get("run_id") != run_id:
            record = self._record = {**record, "run_id": run_id}
            write_record(self.run, RUN_FILE, record)
        client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self._log_missing_params(client, run_id)

    def _reset(self) -> None:
        self._record, self._client, self.run_id = None, None, None

    def _held_counts(self) -> dict[str, int]:
        client, run_id = self._attached()
        keys = client.get_run(run_id).data.metrics
        return {key: len(client.get_metric_history(run_id, key)) for key in keys}

    def _send(self, points: list[Point]) -> None:
        Metric = _import_mlflow().entities.Metric
        client, run_id = self._attached()
        # MLflow keeps one point per (key, step, time, value): a batch sent again after a lost
        # answer adds nothing, and rows of one key at one step stay distinct (their times differ).
        metrics = [Metric(key, value, point.milliseconds, point.step)
                   for point in points for key, value in point.values.items()]
        for start in range(0, len(metrics), _BATCH_METRICS):
            client.log_batch(run_id, metrics=metrics[start:start + _BATCH_METRICS])

    def _finish(self) -> None:
        client, run_id = self._attached()
        client.set_terminated(run_id, "FINISHED")

    def _send_model(self, path: str) -> None:
        client, run_id = self._attached()
        client.log_artifact(run_id, path, artifact_path=MODEL_ARTIFACT)

    # ---- helpers ----------------------------------------------------------------------------
    def _attached(self) -> tuple[Any, str]:
        assert self._client is not None and self.run_id is not None, "called before _connect"
        return self._client, self.run_id

    def _run_with_token(self, client: Any, token: str) -> str | None:
        """The MLflow run created with ``token`` by an earlier process killed before recording it."""
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is None:
            return None
        runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{TOKEN_TAG}` = '{token}'")
        return runs[0].info.run_id if runs else None

    def _log_missing_params(self, client: Any, run_id: str) -> None:
        Param = _import_mlflow().entities.Param
        held = client.get_run(run_id).data.params
        params = [Param(key, value) for key, value in self.run.hyperparameters.items() if key not in held]
        for start in range(0, len(params), _BATCH_PARAMS):
            client.log_batch(run_id, params=params[start:start + _BATCH_PARAMS])


def _import_mlflow() -> ModuleType:
    """mlflow, with its tracking client and entities (imported by the sender thread, not by
    ``import engine``)."""
    try:
        import mlflow.entities
        import mlflow.tracking
    except ImportError as error:
        raise ConfigError(_MISSING) from error
    return mlflow


def _private_random() -> None:
    """Give the modules of ``_DRAWING_MODULES`` their own generator instead of Python's global
    ``random`` (see the module docstring); they draw the same kind of numbers."""
    for name in _DRAWING_MODULES:
        module = sys.modules.get(name) or importlib.import_module(name)
        if getattr(module, "random", None) is random:
            setattr(module, "random", random.Random())
