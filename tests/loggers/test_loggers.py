"""engine.loggers: TensorBoard and CSV receive exactly the rows of metrics.jsonl; a run SIGKILLed
at any instant and resumed leaves TensorBoard scalars (read back with tensorboard's
EventAccumulator) and a CSV equal to those of a run that was never interrupted, every step once;
paths are checked up front; a failing logger warns and the run trains on."""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import warnings

import pytest
import torch

import engine
import engine.loggers
from kill_helpers import kill_at_random_instant, killed_at_the_fault, run_scenario
from plateau_scenario import run_loggers, train_plateau
from resume_helpers import assert_same_run, read_metrics

SCRIPT = str(pathlib.Path(__file__).parent.parent / "plateau_scenario.py")


def metrics_rows(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in read_metrics(run_dir).splitlines()]


def tensorboard_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard reads from ``log_dir``, per tag, in order: (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(log_dir, size_guidance={"scalars": 0})  # 0: keep every event
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def expected_scalars(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The scalars the rows of metrics.jsonl describe, as TensorBoard stores them (float32)."""
    expected: dict[str, list[tuple[int, float]]] = {}

    def add(tag: str, step: int, value: float) -> None:
        expected.setdefault(tag, []).append((step, float(torch.tensor(value, dtype=torch.float32))))

    for row in rows:
        if "loss" in row:
            add(f"{row['stage']}/loss", row["step"], row["loss"])
        for name, value in row.get("metrics", {}).items():
            add(f"{row['stage']}/{name}", row["step"], value)
    return expected


def csv_rows(path: str) -> list[dict[str, str]]:
    import csv

    with open(path, newline="") as file:
        return list(csv.DictReader(file))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plateau scenario (TBPTT, validation every 5 steps and at epoch ends, learning rate
    reduced on plateaus) run once, uninterrupted, with both loggers."""
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_plateau(run_dir, loggers=run_loggers(run_dir))
    return run_dir


def test_the_loggers_receive_exactly_the_rows_of_metrics_jsonl(reference):
    rows = metrics_rows(reference)
    assert {row["stage"] for row in rows} == {"train", "train_epoch", "val"} and len(rows) > 40
    assert tensorboard_scalars(os.path.join(reference, "tensorboard")) == expected_scalars(rows)
    table = csv_rows(os.path.join(reference, "metrics.csv"))
    assert len(table) == len(rows)
    for line, row in zip(table, rows):
        assert line["stage"] == row["stage"] and int(line["step"]) == row["step"]
        assert (float(line["loss"]) if line["loss"] else None) == row.get("loss")
        assert {name: float(value) for name, value in line.items()
                if value and name not in ("stage", "epoch", "batch", "split", "step", "loss")} == row["metrics"]


def assert_same_logs(reference: str, run_dir: str) -> None:
    assert tensorboard_scalars(os.path.join(run_dir, "tensorboard")) == \
        tensorboard_scalars(os.path.join(reference, "tensorboard"))
    assert pathlib.Path(run_dir, "metrics.csv").read_bytes() == pathlib.Path(reference, "metrics.csv").read_bytes()


@pytest.mark.slow
def test_sigkill_after_rows_were_logged_and_before_their_checkpoint(reference, tmp_path):
    # epoch_end is reached after the epoch's validation row and before the epoch's checkpoint;
    # split_end after a split's row and before its checkpoint; checkpoint_before_rename after the
    # loggers flushed the rows a checkpoint seals and before that checkpoint commits them.
    # With a writer process, checkpoint_before_rename kills that process: the training process
    # starts another and ends the run, and the starts after it find the run finished.
    run_dir = str(tmp_path / "run")
    for faults in ["split_end:2:sigkill", "checkpoint_before_rename:3:sigkill", "epoch_end:1:sigkill",
                   "checkpoint_before_rename:4:sigkill", "split_end:5:sigkill", "epoch_end:1:sigkill", None]:
        process = run_scenario("schedule", run_dir, faults, "--loggers", script=SCRIPT)
        assert process.returncode in (0, -signal.SIGKILL), process.stderr[-3000:]
        if faults is not None:
            assert killed_at_the_fault(process.returncode, process.stderr), f"{faults} did not fire"
        if process.returncode == 0:
            break
    assert process.returncode == 0
    assert_same_run(reference, run_dir)
    assert_same_logs(reference, run_dir)


@pytest.mark.slow
def test_sigkill_at_random_instants(reference, tmp_path):
    rng = random.Random(2112)
    run_dir = str(tmp_path / "run")
    kills = 0
    for _ in range(6):
        if not kill_at_random_instant("schedule", run_dir, rng, 1.0, "--sleep", "0.05", "--loggers", script=SCRIPT):
            break
        kills += 1
    process = run_scenario("schedule", run_dir, None, "--loggers", script=SCRIPT)
    assert process.returncode == 0, process.stderr[-3000:]
    assert kills >= 3
    assert_same_run(reference, run_dir)
    assert_same_logs(reference, run_dir)


def test_a_fresh_run_replaces_what_an_earlier_run_logged(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    # An earlier, different run (one epoch, another form of the schedules) in the same places:
    train_plateau(run_dir, form="lightning", loggers=run_loggers(run_dir), max_epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "metrics.jsonl of an earlier run is replaced", retention
        train_plateau(run_dir, loggers=run_loggers(run_dir), resume="off")
    assert_same_logs(reference, run_dir)


def test_a_resumed_processs_event_file_is_read_after_every_earlier_one(tmp_path):
    # TensorBoard reads event files in name order, and a name starts with its creation second:
    # one created in the same second as the newest (here: with a name that sorts last in that
    # second) would be read before it, and its purge would come too early.
    import time

    newest = tmp_path / f"events.out.tfevents.{int(time.time()):010d}.zzzz.99999999.0"
    newest.write_bytes(b"")
    logger = engine.loggers.TensorBoard(tmp_path)
    logger.resume([], 3)
    logger.close()
    assert sorted(os.listdir(tmp_path))[0] == newest.name and len(os.listdir(tmp_path)) == 2


def test_loggers_work_without_a_run_dir(reference, tmp_path):
    logs = str(tmp_path / "logs")
    train_plateau(None, loggers=run_loggers(logs))
    assert_same_logs(reference, logs)


class Failing(engine.loggers.Logger):
    def __init__(self) -> None:
        self.rows = 0

    def log_row(self, row):
        self.rows += 1
        raise OSError(28, "No space left on device")


def test_a_failing_logger_warns_and_the_run_trains_on(reference, tmp_path):
    run_dir, failing = str(tmp_path / "run"), Failing()
    with pytest.warns(UserWarning, match=r"Failing.* could not write a row: OSError: \[Errno 28\] No space left on "
                                         r"device; training goes on"):
        train_plateau(run_dir, loggers=[failing, *run_loggers(run_dir)])
    assert failing.rows == len(metrics_rows(reference))
    assert_same_run(reference, run_dir)
    assert_same_logs(reference, run_dir)  # the other loggers got every row


@pytest.mark.parametrize("make, message", [
    (lambda tmp: engine.loggers.TensorBoard("s3://bucket/tb"), "TensorBoard.log_dir: 's3://bucket/tb' is a URL"),
    (lambda tmp: engine.loggers.TensorBoard(""), "TensorBoard.log_dir: expected a non-empty local path"),
    (lambda tmp: engine.loggers.TensorBoard(tmp / "file"), "TensorBoard.log_dir: .*file' is a file, expected a directory"),
    (lambda tmp: engine.loggers.TensorBoard(tmp, flush_secs=0), "TensorBoard.flush_secs: expected a positive number"),
    (lambda tmp: engine.loggers.CSV(tmp), "CSV.path: .* is a directory, expected a file path"),
    (lambda tmp: engine.loggers.CSV(tmp / "file" / "metrics.csv"), "CSV.path: .* lies under .*file', which is a file"),
    (lambda tmp: engine.loggers.CSV("metrics\n.csv"), "CSV.path: .* contains a control character"),
    (lambda tmp: engine.loggers.CSV(None), "CSV.path: expected a non-empty local path .*, got None"),
    (lambda tmp: engine.TrainerConfig(loggers=engine.loggers.CSV(tmp / "a.csv")), "TrainerConfig.loggers: expected a list"),
    (lambda tmp: engine.TrainerConfig(loggers=["tb"]), "TrainerConfig.loggers: 'tb' is not an engine.loggers.Logger"),
    (lambda tmp: engine.TrainerConfig(loggers=[engine.loggers.CSV(tmp / "a.csv")] * 2), "the same logger is given twice"),
])
def test_paths_and_loggers_are_checked_up_front(tmp_path, make, message):
    (tmp_path / "file").write_text("")
    with pytest.raises(engine.ConfigError, match=message) as caught:
        make(tmp_path)
    assert "\n" not in str(caught.value)


def test_without_tensorboard_installed_the_logger_says_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "tensorboard" else find_spec(name, *args))
    with pytest.raises(engine.ConfigError, match=r"needs the tensorboard package.*pip install 'splitloop\[tensorboard\]'"):
        engine.loggers.TensorBoard(tmp_path)


def test_importing_engine_imports_no_tensorboard_and_no_tracker():
    code = ("import sys, engine, engine.loggers; engine.loggers.MLflow('http://127.0.0.1:1'); "
            "print(sorted(m for m in sys.modules if m.startswith(('tensorboard', 'torch.utils.tensorboard', 'mlflow', "
            "'wandb'))))")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "[]"
