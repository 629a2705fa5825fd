"""engine.lightning.Trainer(logger=...): Lightning's TensorBoardLogger, CSVLogger, MLFlowLogger and
WandbLogger (and a list) become the engine's loggers with their settings; any other logger, or an option with
no engine equivalent, is refused in one line before anything runs."""

from __future__ import annotations

import os
import pathlib
import signal

import pytest
from pytorch_lightning.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger

import engine
import engine.lightning
from lit_modules import build, loaders
from kill_helpers import run_scenario
from resume_helpers import assert_same_run, read_metrics
from tracker_histories import expected_histories
from wandb_files import the_one_run, wandb_environment

LIT_SCRIPT = str(pathlib.Path(__file__).with_name("lit_scenarios.py"))


def test_each_lightning_logger_becomes_the_engines_with_its_settings(tmp_path):
    from engine.lightning._loggers import translate_loggers

    tensorboard, csv, mlflow = translate_loggers([
        TensorBoardLogger(tmp_path, name="lm", version=3), CSVLogger(tmp_path / "csv"),
        MLFlowLogger("lm-experiment", run_name="lm-a", tracking_uri="http://127.0.0.1:1", tags={"team": "speech"})])
    assert isinstance(tensorboard, engine.loggers.TensorBoard)
    assert tensorboard.log_dir == os.path.join(tmp_path, "lm", "version_3")
    assert isinstance(csv, engine.loggers.CSV)
    # Lightning's next free version would change at every restart: a resumed run writes where it wrote.
    assert csv.path == os.path.join(tmp_path / "csv", "lightning_logs", "version_0", "metrics.csv")
    assert isinstance(mlflow, engine.loggers.MLflow)
    assert (mlflow.tracking_uri, mlflow.experiment, mlflow.run_name, mlflow.tags, mlflow.log_model) == \
        ("http://127.0.0.1:1", "lm-experiment", "lm-a", {"team": "speech"}, False)
    assert translate_loggers(None) == [] and translate_loggers(False) == []


def test_a_wandb_logger_becomes_the_engines_with_its_settings(tmp_path):
    from engine.lightning._loggers import translate_loggers

    offline, online = translate_loggers([
        WandbLogger(name="lm-a", save_dir=tmp_path, offline=True, id="run-1", project="lm", entity="team",
                    tags=["speech"], group="sweep"),
        WandbLogger(project="lm", mode="disabled", log_model=True),
        ])
    assert isinstance(offline, engine.loggers.WandB) and isinstance(online, engine.loggers.WandB)
    assert (offline.project, offline.name, offline.mode, offline.dir, offline.id, offline.entity, offline.tags,
            offline.group, offline.log_model) == \
        ("lm", "lm-a", "offline", str(tmp_path), "run-1", "team", ["speech"], "sweep", False)
    assert (online.mode, online.log_model) == ("disabled", True)
    [mlflow] = translate_loggers(MLFlowLogger(tracking_uri="http://127.0.0.1:1", log_model=True))
    assert mlflow.log_model is True


class PrintingLogger(Logger):
    """Any other Lightning logger (WandbLogger, CometLogger, one's own): refused the same way."""

    name, version = "printing", 0

    def log_metrics(self, metrics, step=None):
        print(step, metrics)

    def log_hyperparams(self, params, *args, **kwargs):
        print(params)


@pytest.mark.parametrize("logger, message", [
    (lambda tmp: PrintingLogger(),
     r"^engine.lightning.Trainer: logger PrintingLogger is not supported \(TensorBoardLogger, CSVLogger, "
     r"MLFlowLogger and WandbLogger are; or give an engine.loggers object in TrainerConfig\(loggers=\[...\]\)\)$"),
    (lambda tmp: [TensorBoardLogger(tmp, prefix="x"), MLFlowLogger(tracking_uri="http://127.0.0.1:1", log_model="all")],
     r"^TensorBoardLogger\(prefix='x'\): not supported by engine.lightning \(metrics keep their names .*\); "
     r"MLFlowLogger\(log_model='all'\): not supported by engine.lightning \(.*not every checkpoint\)$"),
    (lambda tmp: WandbLogger(project="lm", offline=True, job_type="train", prefix="p"),
     r"^WandbLogger\(prefix='p'\): not supported by engine.lightning \(metrics keep their names .*\); "
     r"WandbLogger\(job_type='train'\): not supported by engine.lightning \(the engine's WandB takes name, .*\)$"),
    (lambda tmp: True, r"logger=True \(Lightning's default TensorBoard logger\) is not supported"),
])
def test_other_loggers_and_options_are_refused_in_one_line(tmp_path, logger, message):
    with pytest.raises(engine.ConfigError, match=message):
        engine.lightning.Trainer(engine.TrainerConfig(), logger=logger(tmp_path))


def test_a_fit_writes_through_the_translated_loggers_what_the_engines_write(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars(log_dir):
        accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
        accumulator.Reload()
        return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
                for tag in accumulator.Tags()["scalars"]}

    direct = [engine.loggers.TensorBoard(tmp_path / "tb"), engine.loggers.CSV(tmp_path / "metrics.csv")]
    config = engine.TrainerConfig(max_epochs=2, run_dir=str(tmp_path / "run"), progress_bar="off", loggers=direct)
    trainer = engine.lightning.Trainer(config, logger=[TensorBoardLogger(tmp_path / "lit", version=0),
                                                      CSVLogger(tmp_path / "lit", name="csv")])
    train_loader, val_loader = loaders("autoencoder")
    trainer.fit(build("autoencoder"), train_loader, val_loader)
    lines = (tmp_path / "metrics.csv").read_bytes()
    assert lines.count(b"\n") > 10
    assert (tmp_path / "lit" / "csv" / "version_0" / "metrics.csv").read_bytes() == lines
    assert scalars(tmp_path / "lit" / "lightning_logs" / "version_0") == scalars(tmp_path / "tb")


@pytest.mark.exhaustive  # CI time (about 20 s: the default run keeps the mapping of each Lightning logger and the W&B tests of tests/loggers)
def test_a_fit_through_a_wandb_logger_fills_one_offline_wandb_run_with_the_rows(tmp_path, monkeypatch):
    for key, value in wandb_environment(tmp_path / "home").items():
        monkeypatch.setenv(key, value)
    run_dir = str(tmp_path / "run")
    config = engine.TrainerConfig(max_epochs=1, run_dir=run_dir, progress_bar="off")
    trainer = engine.lightning.Trainer(config, logger=WandbLogger(project="lm", save_dir=tmp_path / "wandb",
                                                                  offline=True))
    train_loader, val_loader = loaders("autoencoder")
    trainer.fit(build("autoencoder"), train_loader, val_loader)
    run = the_one_run(tmp_path / "wandb", run_dir)
    assert run.histories() == expected_histories(run_dir)
    assert len(run.history) == len(read_metrics(run_dir).splitlines()) > 3
    assert run.config()["config/run_dir"] == run_dir


@pytest.mark.slow
@pytest.mark.exhaustive  # four Lightning processes with W&B; the default run keeps the fit above
def test_a_lightning_run_sigkilled_in_validation_and_training_is_one_wandb_run_equal_to_an_uninterrupted_one(
        tmp_path, monkeypatch):
    for key, value in wandb_environment(tmp_path / "home").items():
        monkeypatch.setenv(key, value)
    reference_dir, run_dir = str(tmp_path / "reference"), str(tmp_path / "run")
    assert run_scenario("checkpointed", reference_dir, None, "--wandb", str(tmp_path / "wandb-reference"),
                        script=LIT_SCRIPT).returncode == 0
    for faults in ("validation_batch_end:2:sigkill", "split_end:5:sigkill"):
        killed = run_scenario("checkpointed", run_dir, faults, "--wandb", str(tmp_path / "wandb"), script=LIT_SCRIPT)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    process = run_scenario("checkpointed", run_dir, None, "--wandb", str(tmp_path / "wandb"), script=LIT_SCRIPT)
    assert process.returncode == 0, process.stderr[-3000:]
    assert_same_run(reference_dir, run_dir)
    reference, run = the_one_run(tmp_path / "wandb-reference", reference_dir), the_one_run(tmp_path / "wandb", run_dir)
    # (A process killed before its sender's wandb.init ended leaves no run file: up to three files.)
    assert len(run.files) <= 3 and run.histories() == reference.histories() == expected_histories(run_dir)
    steps = sorted(item["_step"] for item in run.history)
    assert steps == list(range(len(read_metrics(run_dir).splitlines())))
    keys = [key for update in run.configs for key in update]
    assert len(keys) == len(set(keys))  # the config set once
