"""Best checkpoints by a monitored metric: kept beside the newest, never deleted by retention,
shown by inspect, loadable with load_weights(checkpoint="best"), replaced when corrupt."""

from __future__ import annotations

import json
import os

import pytest
import torch

import engine
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.cli.commands import inspect_run
from validation_scenarios import build_validated, train_validated


def policy(**overrides):
    settings = dict(keep_last=2, monitor="val_loss", mode="min", keep_best=2)
    settings.update(overrides)
    return engine.CheckpointConfig(**settings)


def val_rows(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [row for row in rows if row["stage"] == "val"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("run"))
    train_validated(run_dir, epochs=3, every_steps=4, checkpoint=policy())
    return run_dir


def test_the_best_are_kept_beside_the_newest_and_match_the_best_validations(run):
    store = CheckpointStore(Storage(run))
    rows = sorted(val_rows(run), key=lambda row: row["metrics"]["val_loss"])
    best = store.best(2)
    assert len(best) == 2
    for name, row in zip(best, rows[:2]):
        loaded = store.load(name)
        assert loaded.manifest.monitor.value == row["metrics"]["val_loss"]
        cursor = loaded.progress.cursor
        assert (cursor.epoch, cursor.batch, cursor.split) == (row["epoch"], row["batch"], row["split"])
    # keep_last counts the checkpoints that are not best: the two newest of those remain too
    newest = [name for name, _ in store.newest_first() if name not in best][:2]
    assert len(newest) == 2
    assert set(store.names()) == set(newest) | set(best)


def test_keep_best_for_max_mode(tmp_path):
    run_dir = str(tmp_path / "run")
    train_validated(run_dir, epochs=2, every_steps=4, checkpoint=policy(monitor="val_noise", mode="max", keep_best=1))
    best_value = max(row["metrics"]["val_noise"] for row in val_rows(run_dir))
    store = CheckpointStore(Storage(run_dir))
    [best] = store.best(1)
    assert store.load(best).manifest.monitor.value == best_value


def test_inspect_shows_the_best(run, capsys):
    report = inspect_run(run)
    store = CheckpointStore(Storage(run))
    assert report["best"] == store.best(1)[0]
    entry = next(e for e in report["checkpoints"] if e["name"] == report["best"])
    assert entry["monitor"]["name"] == "val_loss"
    from engine.cli import main

    assert main(["inspect", run]) == 0
    out = capsys.readouterr().out
    assert f"best: {report['best']}" in out and "BEST" in out


def test_load_weights_best(run):
    model, _ = build_validated()
    name = engine.load_weights(model, run, checkpoint="best")
    expected = CheckpointStore(Storage(run)).load(name).state["module"]
    assert name == CheckpointStore(Storage(run)).best(1)[0]
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[key])


def test_a_corrupt_best_is_reported_and_replaced(run, tmp_path):
    import shutil

    run_dir = str(tmp_path / "copy")
    shutil.copytree(run, run_dir)
    store = CheckpointStore(Storage(run_dir))
    first, second = store.best(2)
    with open(os.path.join(run_dir, "checkpoints", first, "tensors.bin"), "r+b") as handle:
        handle.write(b"\x00\x01\x02")
    store = CheckpointStore(Storage(run_dir))
    assert store.best(1) == [second]
    report = inspect_run(run_dir)
    assert report["best"] == second
    assert next(e for e in report["checkpoints"] if e["name"] == first)["valid"] is False
    # training on: retention deletes the corrupt one and keeps two valid best ones
    train_validated(run_dir, epochs=4, every_steps=4, checkpoint=policy())
    store = CheckpointStore(Storage(run_dir))
    assert first not in store.names()
    assert len(store.best(2)) == 2


def test_without_a_best_checkpoint_load_weights_says_why(tmp_path):
    run_dir = str(tmp_path / "run")
    train_validated(run_dir, epochs=1, every_steps=None)
    with pytest.raises(engine.CheckpointNotFound, match="monitor"):
        engine.load_weights(build_validated()[0], run_dir, checkpoint="best")


def test_a_monitor_that_is_never_produced_is_refused_by_name(tmp_path):
    with pytest.raises(engine.ConfigError, match="val_los.*val_loss"):
        train_validated(str(tmp_path / "run"), epochs=1, checkpoint=policy(monitor="val_los"))


@pytest.mark.parametrize("kwargs, field", [(dict(monitor=""), "monitor"), (dict(mode="low"), "mode"),
                                           (dict(keep_best=-1), "keep_best")])
def test_bad_best_settings(kwargs, field):
    with pytest.raises(engine.ConfigError, match=field):
        engine.CheckpointConfig(**kwargs)
