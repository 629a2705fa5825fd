"""The test switch SPLITLOOP_TEST_WRITER (tests/writer_switch.py): it turns the writer process on
where the engine accepts one, and leaves the other configurations as the scenario built them."""

import pytest

import engine
from writer_switch import VARIABLE, trainer_config


def checkpoint_of(**settings):
    return trainer_config(max_epochs=1, progress_bar="off", **settings).checkpoint


def test_unset_it_changes_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv(VARIABLE, raising=False)
    assert checkpoint_of(run_dir=str(tmp_path)) == engine.CheckpointConfig()


def test_process_writes_a_local_run_dirs_checkpoints_in_a_writer_process(monkeypatch, tmp_path):
    monkeypatch.setenv(VARIABLE, "process")
    checkpoint = checkpoint_of(run_dir=str(tmp_path), checkpoint=engine.CheckpointConfig(every_n_splits=4, keep_last=2))
    assert checkpoint.writer == "process"
    assert (checkpoint.every_n_splits, checkpoint.keep_last) == (4, 2)


@pytest.mark.parametrize("settings", [
    dict(run_dir="memory://switch"),
    dict(run_dir="objectdir:///tmp/switch"),
    dict(run_dir=None),
    dict(run_dir="RUN", checkpoint=None),
    dict(run_dir="RUN", checkpoint=engine.CheckpointConfig(local_tier="/dev/shm/switch", durable_every_n_splits=2)),
], ids=["memory", "object-store", "no-run-dir", "no-checkpoints", "fast-tier"])
def test_process_keeps_what_the_writer_process_refuses(settings, monkeypatch, tmp_path):
    monkeypatch.delenv(VARIABLE, raising=False)
    settings = {**settings, "run_dir": str(tmp_path) if settings["run_dir"] == "RUN" else settings["run_dir"]}
    unchanged = checkpoint_of(**settings)
    monkeypatch.setenv(VARIABLE, "process")
    assert checkpoint_of(**settings) == unchanged


def test_process_keeps_a_torchrun_rank_as_it_is(monkeypatch, tmp_path):
    monkeypatch.setenv(VARIABLE, "process")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert checkpoint_of(run_dir=str(tmp_path)).writer == engine.CheckpointConfig().writer


def test_an_unknown_writer_is_refused_naming_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(VARIABLE, "processes")
    with pytest.raises(ValueError, match=f"{VARIABLE}='processes'"):
        checkpoint_of(run_dir=str(tmp_path))
