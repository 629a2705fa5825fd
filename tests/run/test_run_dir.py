"""A run directory that cannot be used fails before training with one ConfigError naming the
path and what to do, never an OSError from inside the checkpoint code."""

import fsspec
import pytest
import torch

import engine
from engine.run.run_dir import check_existing_run_dir, check_run_dir
from models import Regression


def fit(run_dir):
    config = engine.TrainerConfig(max_epochs=1, run_dir=str(run_dir), progress_bar="off")
    return engine.Trainer(config).fit(Regression(), [torch.randn(3, 2) for _ in range(2)])


def test_a_run_dir_that_is_a_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("x")
    with pytest.raises(engine.ConfigError, match=r"TrainerConfig\.run_dir: '.*notes\.txt' is an existing file, not a directory"):
        fit(path)


def test_a_run_dir_under_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(engine.ConfigError, match=r"cannot create '.*notes\.txt/run': a part of the path is a file"):
        fit(tmp_path / "notes.txt" / "run")


def test_a_run_dir_that_cannot_be_created():
    # /proc refuses new entries, also to root (a chmod-based test would not fail as root).
    with pytest.raises(engine.ConfigError, match=r"cannot create '/proc/splitloop-no-such-dir/run': .*choose a location you can write to"):
        fit("/proc/splitloop-no-such-dir/run")


def test_an_existing_run_dir_that_is_not_writable():
    with pytest.raises(engine.ConfigError, match=r"cannot write to '/proc/self': .*choose a directory you can write to"):
        fit("/proc/self")


def test_checkpoints_inside_the_run_dir_is_a_file(tmp_path):
    (tmp_path / "checkpoints").write_text("x")
    with pytest.raises(engine.ConfigError, match=r"holds a file named 'checkpoints'.*move that file away"):
        fit(tmp_path)


def test_metrics_file_is_a_directory(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(engine.ConfigError, match=r"holds a directory named 'metrics.jsonl'"):
        fit(tmp_path)


def test_a_good_run_dir_is_created_and_left_clean(tmp_path):
    run_dir = tmp_path / "new" / "run"
    check_run_dir(str(run_dir))
    assert run_dir.is_dir() and list(run_dir.iterdir()) == []


def test_memory_urls_are_checked_too():
    check_run_dir("memory://run-dir-check/run")
    fsspec.filesystem("memory").pipe("/run-dir-check/file", b"x")
    with pytest.raises(engine.ConfigError, match="is an existing file"):
        check_run_dir("memory://run-dir-check/file")


def test_readers_are_told_a_file_is_not_a_run_dir(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(engine.ConfigError, match=r"'.*f' is a file, not a run directory"):
        check_existing_run_dir(str(tmp_path / "f"))
    with pytest.raises(engine.ConfigError, match="does not exist"):
        check_existing_run_dir(str(tmp_path / "missing"))
