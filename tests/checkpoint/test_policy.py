"""The checkpoint policy: when a checkpoint is due, and which one a run resumes from."""

import pytest

import engine
from engine.checkpoint.policy import RunCheckpointer
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.metrics_log import MetricsLog
from engine.run import state as run_state
from scenarios import train_with_checkpoints


def checkpointer(tmp_path, **policy):
    storage = Storage(str(tmp_path / "run"))
    config = engine.CheckpointConfig(**policy)
    return RunCheckpointer(storage, config.plan(), MetricsLog(storage))


def test_every_n_splits(tmp_path):
    policy = checkpointer(tmp_path, every_n_splits=3)
    assert [units for units in range(1, 10) if policy.due_at_split(units, 0)] == [3, 6, 9]


def test_every_n_steps_fires_when_the_count_crosses_a_multiple(tmp_path):
    policy = checkpointer(tmp_path, every_n_splits=None, every_n_steps=4)
    policy.start(optimizer_steps=0, resumed_mark=None)
    assert not policy.due_at_split(1, 3)
    assert policy.due_at_split(2, 5)  # 5 crosses 4 although 4 itself was never a boundary


def test_every_seconds(tmp_path, monkeypatch):
    import engine.checkpoint.cadence as policy_module

    now = [1000.0]
    monkeypatch.setattr(policy_module.time, "monotonic", lambda: now[0])
    policy = checkpointer(tmp_path, every_n_splits=None, every_seconds=30)
    assert not policy.due_at_split(1, 1)
    now[0] += 30
    assert policy.due_at_split(2, 2)


def test_epoch_end_follows_the_flag(tmp_path):
    assert checkpointer(tmp_path, at_epoch_end=True).due_at_epoch_end()
    assert not checkpointer(tmp_path, at_epoch_end=False).due_at_epoch_end()


def test_holds_names_the_boundary_of_the_last_checkpoint(tmp_path):
    policy = checkpointer(tmp_path)
    policy.start(optimizer_steps=0, resumed_mark=(4, 1))
    assert policy.holds((4, 1)) and not policy.holds((5, 1))


@pytest.fixture
def trained(tmp_path):
    run_dir = str(tmp_path / "trained")
    train_with_checkpoints("tbptt", run_dir, epochs=1, keep_last=None)
    return run_dir


def selector(run_dir):
    storage = Storage(run_dir)
    return RunCheckpointer(storage, engine.CheckpointConfig().plan(), MetricsLog(storage))


def test_select_off_auto_latest_and_by_name(trained):
    policy = selector(trained)
    names = policy.store.names()
    assert policy.select("off", run_state.validate) is None
    assert policy.select("auto", run_state.validate).name == names[-1]
    assert policy.select("latest", run_state.validate).name == names[-1]
    assert policy.select(names[1], run_state.validate).name == names[1]


def test_select_skips_checkpoints_the_validator_refuses(trained):
    policy = selector(trained)
    names = policy.store.names()

    def refuse_newest(name, state):
        if name == names[-1]:
            raise engine.CheckpointCorrupt(f"{name}: refused by the test")

    with pytest.warns(UserWarning, match=names[-1]):
        assert policy.select("auto", refuse_newest).name == names[-2]


def test_select_refuses_to_start_over_when_nothing_verifies(trained):
    def refuse_all(name, state):
        raise engine.CheckpointCorrupt(f"{name}: refused")

    with pytest.warns(UserWarning), pytest.raises(engine.CheckpointCorrupt, match="refusing to start over"):
        selector(trained).select("auto", refuse_all)


def test_select_latest_in_an_empty_dir_is_not_found(tmp_path):
    with pytest.raises(engine.CheckpointNotFound):
        selector(str(tmp_path / "empty")).select("latest", run_state.validate)
    assert selector(str(tmp_path / "empty2")).select("auto", run_state.validate) is None
