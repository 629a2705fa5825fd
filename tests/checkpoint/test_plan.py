"""engine.checkpoint.plan: CheckpointConfig resolved once, its cross-field rules and refusals, the
one ``writer`` choice (and the deprecated ``asynchronous`` spelling), and a writer added with one
line where writers are chosen."""

from __future__ import annotations

import warnings

import pytest

import engine
from engine.checkpoint.plan import CheckpointPlan
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.writers.choice import WRITER_KINDS
from scenarios import train_with_checkpoints


def test_the_plan_holds_each_part_of_the_configuration():
    config = engine.CheckpointConfig(every_n_splits="auto", max_overhead=0.1, mtbf_seconds=7200.0, every_seconds=30.0,
                                     keep_last=3,
                                     monitor="val_loss", mode="max", keep_best=2, writer="thread", max_in_flight=2,
                                     when_behind="skip", on_io_error="warn", local_tier="/dev/shm/plan-test",
                                     durable_every_n_splits=4)
    plan = config.plan()
    assert (plan.cadence.auto, plan.cadence.every_n_splits, plan.cadence.max_overhead, plan.cadence.mtbf_seconds,
            plan.cadence.every_seconds) == (True, None, 0.1, 7200.0, 30.0)
    assert (plan.writer.kind, plan.writer.max_in_flight, plan.writer.when_behind, plan.writer.on_io_error) == \
        ("thread", 2, "skip", "warn")
    assert (plan.retention.keep_last, plan.retention.monitor, plan.retention.mode, plan.retention.keep_best) == \
        (3, "val_loss", "max", 2)
    assert (plan.tiers.local_tier, plan.tiers.durable_every_n_splits, plan.tiers.durable_every_seconds) == \
        ("/dev/shm/plan-test", 4, None)
    assert engine.CheckpointConfig().plan().retention.keep_best == 0  # no monitor: no best checkpoint kept


def test_the_default_writer_is_synchronous_and_each_writer_is_one_word():
    assert engine.CheckpointConfig().plan().writer.kind == "sync"
    for kind in ("sync", "thread", "process"):
        assert engine.CheckpointConfig(writer=kind).plan().writer.kind == kind


@pytest.mark.parametrize("old, writer", [(dict(asynchronous=True), "thread"),
                                         (dict(asynchronous=True, writer="process"), "process"),
                                         (dict(asynchronous=False), "sync"),
                                         (dict(asynchronous=False, writer="thread"), "sync")])
def test_the_old_asynchronous_spelling_still_works_with_one_deprecation_line(old, writer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = engine.CheckpointConfig(**old)
    assert config == engine.CheckpointConfig(writer=writer)
    (warning,) = caught
    assert warning.category is FutureWarning and warning.filename == __file__
    assert f"say writer={writer!r} alone" in str(warning.message)


def test_asynchronous_false_with_a_background_writer_is_a_contradiction():
    with pytest.raises(engine.ConfigError, match="writer='process' writes in the background, but asynchronous is False"):
        engine.CheckpointConfig(asynchronous=False, writer="process")


@pytest.mark.parametrize("config, where, message", [
    (dict(local_tier="/dev/shm/plan-test", durable_every_n_splits=2, peer_copies=1), dict(),
     "peer_copies=1 copies each rank's memory parts to another node of a torchrun job; this run is one process"),
    (dict(writer="process", local_tier="/dev/shm/plan-test", durable_every_n_splits=2), dict(),
     "writer='process' is not supported with local_tier in a process alone"),
    (dict(writer="process"), dict(run_dir_url="s3://bucket/run", run_dir_is_local=False),
     "writer='process' needs a local run dir for now, got 's3://bucket/run'"),
])
def test_what_cannot_work_where_the_run_writes_is_refused(config, where, message):
    plan = engine.CheckpointConfig(**config).plan()
    arguments = dict(distributed=False, run_dir_url="/tmp/run", run_dir_is_local=True) | where
    with pytest.raises(engine.ConfigError, match=message):
        plan.refuse_where(**arguments)
    if "local_tier" not in config:
        plan.refuse_where(distributed=False, run_dir_url="/tmp/run", run_dir_is_local=True)  # one local process: fine


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_memory_tier_under_torchrun_is_accepted_with_either_background_writer(writer):
    engine.CheckpointConfig(local_tier="/dev/shm/plan-test", durable_every_n_splits=2, peer_copies=1,
                            writer=writer).plan().refuse_where(distributed=True, run_dir_url="/tmp/run", run_dir_is_local=True)


def test_a_memory_tier_under_torchrun_is_accepted_and_peer_copies_need_one():
    engine.CheckpointConfig(local_tier="/dev/shm/plan-test", durable_every_n_splits=2, peer_copies=1).plan().refuse_where(
        distributed=True, run_dir_url="/tmp/run", run_dir_is_local=True)
    with pytest.raises(engine.ConfigError, match="peer_copies=1 copies the memory tier's parts to a peer node; set local_tier"):
        engine.CheckpointConfig(peer_copies=1)
    for bad in (2, -1, True, "1", 1.0):
        with pytest.raises(engine.ConfigError, match="peer_copies: expected 0 or 1"):
            engine.CheckpointConfig(local_tier="/dev/shm/x", durable_every_n_splits=2, peer_copies=bad)


def test_a_plan_refuses_a_combination_it_cannot_honour():
    class Settings:  # a configuration changed behind CheckpointConfig's back (no field checks)
        every_n_splits, every_n_steps, every_seconds, at_epoch_end, max_overhead, mtbf_seconds = 1, None, None, True, 0.05, None
        keep_last, monitor, mode, keep_best = 2, None, "min", 1
        writer, max_in_flight, when_behind, on_io_error, lease_expiry_seconds = "sync", 1, "wait", "raise", 60.0
        local_tier, durable_every_n_splits, durable_every_seconds, peer_copies = None, 3, None, 0

    with pytest.raises(engine.ConfigError, match="durable_every_n_splits / durable_every_seconds: only meaningful"):
        CheckpointPlan.from_config(Settings())


class CountingWriterKind:
    """A writer added the way the choice's docstring says: a kind in WRITER_KINDS (here, the
    synchronous writer, counted)."""

    uses_process = False
    built: list = []

    def launch(self, storage, lease):
        pass

    def build(self, parts):
        writer = WRITER_KINDS["sync"]().build(parts)
        CountingWriterKind.built.append(writer)
        return writer

    def abandon(self):
        pass


def test_a_writer_added_in_one_line_is_accepted_and_used(tmp_path, monkeypatch):
    monkeypatch.setitem(WRITER_KINDS, "counting", CountingWriterKind)
    monkeypatch.setattr(CountingWriterKind, "built", [])
    run_dir = str(tmp_path / "run")
    train_with_checkpoints("tbptt", run_dir, epochs=1, asynchronous=True, writer="counting")
    (writer,) = CountingWriterKind.built
    assert writer.last_name is not None and writer.last_name == sorted(CheckpointStore(Storage(run_dir)).committed_names())[-1]
    monkeypatch.delitem(WRITER_KINDS, "counting")
    with pytest.raises(engine.ConfigError, match="writer: expected one of .*got 'counting'"):
        engine.CheckpointConfig(writer="counting")
