"""Graceful preemption: SIGTERM / SIGUSR1 finish the split in progress, commit a checkpoint of
it, flush pending writes and exit with the documented code; the resume is bit-exact."""

import signal
import uuid

import pytest

from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from kill_helpers import AtSplit, signals_to_self, sigterm_to_self
from progress import Cursor
from resume_helpers import assert_same_run, read_metrics
from scenarios import train_with_checkpoints


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_with_checkpoints("tbptt", run_dir, every=4)
    return run_dir


def latest_cursor(run_dir):
    return CheckpointStore(Storage(run_dir)).latest().progress.cursor


@pytest.mark.parametrize("asynchronous", [False, True])
def test_sigterm_checkpoints_the_split_and_exits_with_the_code(asynchronous, reference, tmp_path):
    run_dir = str(tmp_path / "run")
    with pytest.raises(SystemExit) as exit_info:
        train_with_checkpoints("tbptt", run_dir, every=4, asynchronous=asynchronous, callbacks=(AtSplit(10, sigterm_to_self),))
    assert exit_info.value.code == 75
    # split 10 = epoch 0, batch 2, split 1: not a multiple of 4, checkpointed because of the signal
    assert latest_cursor(run_dir) == Cursor(0, 2, 1, 0)
    assert read_metrics(run_dir).count(b"\n") == 10
    result = train_with_checkpoints("tbptt", run_dir, every=4, asynchronous=asynchronous)
    assert result.resumed_cursor == Cursor(0, 2, 1, 0)
    assert_same_run(reference, run_dir)


def test_second_signal_while_stopping_changes_nothing(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    config = dict(every=4, exit_on_preemption=False,
                  callbacks=(AtSplit(7, signals_to_self, signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR1),))
    result = train_with_checkpoints("tbptt", run_dir, **config)
    assert result.preempted and result.stop_reason == "preempted by SIGUSR1"
    assert latest_cursor(run_dir) == Cursor(0, 1, 2, 0)
    train_with_checkpoints("tbptt", run_dir, every=4)
    assert_same_run(reference, run_dir)


def test_requeue_command_runs_after_the_commit(tmp_path):
    run_dir = str(tmp_path / "run")
    marker = tmp_path / "requeued"
    command = f"ls {run_dir}/checkpoints > {marker}"
    result = train_with_checkpoints("tbptt", run_dir, every=100, exit_on_preemption=False, requeue_command=command,
                                    callbacks=(AtSplit(3, sigterm_to_self),))
    assert result.preempted
    listed = marker.read_text().split()
    assert result.last_checkpoint in listed  # the preemption checkpoint was committed before


def test_handlers_are_restored_after_fit(tmp_path):
    def previous_handler(number, frame):
        pass

    old = signal.signal(signal.SIGTERM, previous_handler)
    try:
        train_with_checkpoints("plain", str(tmp_path / "run"))
        assert signal.getsignal(signal.SIGTERM) is previous_handler
    finally:
        signal.signal(signal.SIGTERM, old)


def test_memory_run_dir_preempts_too():
    run_dir = f"memory://preempt-{uuid.uuid4().hex}"
    result = train_with_checkpoints("tbptt", run_dir, every=5, exit_on_preemption=False, callbacks=(AtSplit(6, sigterm_to_self),))
    assert result.preempted and latest_cursor(run_dir) == Cursor(0, 1, 1, 0)
