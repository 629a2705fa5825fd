"""engine.loggers.WandB in offline mode, read back from its run files with wandb's own reader
(tests/wandb_files.py): the W&B run holds exactly the rows of metrics.jsonl, each once, and the
hyperparameters as its config; a run SIGKILLed and resumed is one W&B run (one id, one offline
directory per process) whose metric histories equal an uninterrupted run's, its config set once;
a W&B that cannot write costs one warning and the unsent rows are listed; training is the same
bit for bit (RNG included) with the logger as without a kill."""

from __future__ import annotations

import os
import pathlib
import random
import warnings

import pytest
import torch

import engine
import engine.loggers
from kill_helpers import kill_at_random_instant, run_scenario
from plateau_scenario import train_plateau
from resume_helpers import assert_same_run, read_metrics
from tracker_histories import expected_histories, kill_once
from wandb_files import history_written, read_offline_runs, the_one_run, wandb_environment

SCRIPT = str(pathlib.Path(__file__).parent.parent / "plateau_scenario.py")
PROJECT = "splitloop-tests"


@pytest.fixture(scope="module")
def wandb_home(tmp_path_factory):
    """W&B offline, silent, its settings and caches in a temporary directory (no network)."""
    home = tmp_path_factory.mktemp("wandb-home")
    saved = {key: os.environ.get(key) for key in wandb_environment(home)}
    os.environ.update(wandb_environment(home))
    yield home
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def reference(wandb_home, tmp_path_factory):
    """The plateau scenario (TBPTT, validation, learning rate reduced on plateaus) run once,
    uninterrupted, with the W&B logger."""
    root = tmp_path_factory.mktemp("reference")
    run_dir, wandb_dir = str(root / "run"), root / "wandb"
    train_plateau(run_dir, loggers=[engine.loggers.WandB(project=PROJECT, mode="offline", dir=wandb_dir)])
    return run_dir, the_one_run(wandb_dir, run_dir)


def without_run_dir(config: dict) -> dict:
    return {key: value for key, value in config.items() if key != "config/run_dir"}


def assert_each_step_once(run) -> None:
    """The W&B steps are the rows' numbers, 0, 1, 2, ..., each written once over all the files."""
    steps = sorted(item["_step"] for item in run.history)
    assert steps == list(range(len(steps))), steps


def test_the_wandb_run_holds_exactly_the_rows_of_metrics_jsonl_and_the_config(reference):
    run_dir, run = reference
    assert run.histories() == expected_histories(run_dir)  # W&B keeps 64-bit floats: exact
    assert_each_step_once(run)
    assert len(run.history) == len(read_metrics(run_dir).splitlines())
    assert len(run.files) == 1 and run.finished == 1
    config = run.config()
    assert config["config/max_epochs"] == "3" and config["config/val_every_n_steps"] == "5"
    assert config["config/run_dir"] == run_dir
    assert not any(key.startswith("config/loggers") for key in config)


@pytest.mark.exhaustive  # CI time (a minute here): the default run kills the MLflow logger, on the same _tracker machinery
def test_a_run_killed_after_rows_reached_wandb_resumes_into_the_same_run_each_step_once(reference, tmp_path):
    reference_dir, reference_run = reference
    run_dir, wandb_dir = str(tmp_path / "run"), tmp_path / "wandb"
    kill_once(SCRIPT, run_dir, ["--wandb", str(wandb_dir), PROJECT], lambda: history_written(wandb_dir) >= 5)
    [killed] = read_offline_runs(wandb_dir).values()
    rows = len(read_metrics(reference_dir).splitlines())
    assert 0 < len(killed.history) < rows, "the kill should land once W&B holds some rows, not all"
    process = run_scenario("schedule", run_dir, None, "--wandb", str(wandb_dir), PROJECT, script=SCRIPT)
    assert process.returncode == 0, process.stderr[-3000:]
    assert_same_run(reference_dir, run_dir)  # the RNG streams too: W&B draws none of the training's
    run = the_one_run(wandb_dir, run_dir)
    assert len(run.files) == 2 and run.finished == 1
    assert_each_step_once(run)
    assert run.histories() == reference_run.histories()
    # The config is set once: the resumed process set none of the keys the first one had set.
    keys = [key for update in run.configs for key in update]
    assert len(keys) == len(set(keys))
    assert without_run_dir(run.config()) == without_run_dir(reference_run.config())


@pytest.mark.slow
@pytest.mark.exhaustive
def test_sigkill_at_random_instants(reference, tmp_path):
    reference_dir, reference_run = reference
    rng = random.Random(36)
    run_dir, wandb_dir = str(tmp_path / "run"), tmp_path / "wandb"
    kills = 0
    for _ in range(8):
        # Within the first 1.5 s of training, of a run of a few seconds (validation passes included).
        if not kill_at_random_instant("schedule", run_dir, rng, 1.5, "--sleep", "0.1", "--wandb", str(wandb_dir),
                                      PROJECT, script=SCRIPT):
            break
        kills += 1
    process = run_scenario("schedule", run_dir, None, "--wandb", str(wandb_dir), PROJECT, script=SCRIPT)
    assert process.returncode == 0, process.stderr[-3000:]
    assert kills >= 3
    assert_same_run(reference_dir, run_dir)
    run = the_one_run(wandb_dir, run_dir)
    assert_each_step_once(run)
    assert run.histories() == reference_run.histories()
    keys = [key for update in run.configs for key in update]
    assert len(keys) == len(set(keys))
    assert without_run_dir(run.config()) == without_run_dir(reference_run.config())


def tracker_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(warning.message) for warning in caught if "engine.loggers.WandB" in str(warning.message)]


def test_a_wandb_that_cannot_write_costs_one_warning_and_lists_the_unsent_rows(wandb_home, tmp_path):
    blocked = tmp_path / "wandb"
    logger = engine.loggers.WandB(project=PROJECT, mode="offline", dir=blocked, retry_seconds=0.1, close_timeout=0.5)
    blocked.write_text("a file where W&B wants its directory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_plateau(str(tmp_path / "run"), loggers=[logger], max_epochs=1)
    messages = tracker_warnings(caught)
    assert len(messages) == 2 and "cannot reach the tracker" in messages[0] and "training goes on" in messages[0]
    rows = len(read_metrics(str(tmp_path / "run")).splitlines())
    assert len(logger.unsent) == rows and f"{rows} committed rows (steps" in messages[1]


@pytest.mark.parametrize("make, message", [
    (lambda: engine.loggers.WandB(project=""), "WandB.project: expected a non-empty string, got ''"),
    (lambda: engine.loggers.WandB(mode="shared"), r"WandB.mode: expected one of \['online', 'offline', 'disabled'\]"),
    (lambda: engine.loggers.WandB(id="Not/Valid"), "WandB.id: expected up to 64 lowercase letters"),
    (lambda: engine.loggers.WandB(tags="a"), "WandB.tags: expected a list of strings"),
    (lambda: engine.loggers.WandB(dir="s3://bucket/wandb"), "WandB.dir: 's3://bucket/wandb' is a URL"),
    (lambda: engine.loggers.WandB(retry_seconds=0), "WandB.retry_seconds: expected a positive number of seconds"),
])
def test_settings_are_checked_up_front(make, message):
    with pytest.raises(engine.ConfigError, match=message):
        make()


def test_log_model_logs_the_weights_of_the_last_checkpoint_as_an_artifact(wandb_home, tmp_path):
    run_dir, wandb_dir = str(tmp_path / "run"), tmp_path / "wandb"
    model, _ = train_plateau(run_dir, max_epochs=1, loggers=[
        engine.loggers.WandB(project=PROJECT, mode="offline", dir=wandb_dir, log_model=True)])
    from safetensors.torch import load_file

    run = the_one_run(wandb_dir, run_dir)
    [artifact] = run.artifacts
    assert (artifact["name"], artifact["type"]) == (f"model-{run.run_id}", "model")
    [entry] = artifact["manifest"]["contents"]
    assert entry["path"] == "model.safetensors"
    weights, trained = load_file(entry["local_path"]), model.state_dict()  # the file W&B staged for upload
    assert weights.keys() == trained.keys() and all(torch.equal(weights[key], trained[key]) for key in trained)


# Three W&B attachments in one process (seconds each): exhaustive; the default run keeps the kill
# test, which attaches again in a new process.
@pytest.mark.exhaustive
def test_rollbacks_in_one_process_stay_in_the_one_wandb_run(wandb_home, tmp_path):
    """engine.Rollback restores a checkpoint in the same process twice: each time the logger
    ends its attachment and attaches again (a new offline directory), sending on from the first
    row the W&B run lacks."""
    from rollback_scenario import train_poisoned

    run_dir, wandb_dir = str(tmp_path / "run"), tmp_path / "wandb"
    train_poisoned("nan", run_dir, loggers=[
        engine.loggers.WandB(project=PROJECT, mode="offline", dir=wandb_dir, retry_seconds=0.1)])
    run = the_one_run(wandb_dir, run_dir)
    assert len(run.files) == 3 and run.finished == 3  # the start and each of the two rollbacks
    assert_each_step_once(run)
    assert run.histories() == expected_histories(run_dir)
