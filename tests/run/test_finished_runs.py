"""A finished run stays finished: started again (a requeue, a torchrun restart) or killed right
after its stopping commit, it trains nothing more and its checkpoint, parameters and
metrics.jsonl stay those of the run that ended; raising a limit trains on, saying so. A
preemption is not an end."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import forkserver
import pytest
import torch

import engine
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from early_stop_scenario import early_stopper, train_early_stopped
from kill_helpers import AtSplit, sigterm_to_self
from resume_helpers import assert_same_run, read_metrics
from scenarios import train_with_checkpoints
from validation_scenarios import train_validated

SCRIPT = str(pathlib.Path(__file__).parent.parent / "early_stop_scenario.py")
TIMEOUT = 120


def run_script(run_dir, faults=None):
    """early_stop_scenario.py in a real process; returns the completed process."""
    env = dict(os.environ)
    env.pop("SPLITLOOP_FAULTS", None)
    if faults:
        env["SPLITLOOP_FAULTS"] = faults
    return forkserver.run([sys.executable, SCRIPT, run_dir], env=env, capture_output=True, text=True, timeout=TIMEOUT)


def latest(run_dir):
    return CheckpointStore(Storage(run_dir)).latest()


@pytest.fixture(scope="module")
def early_stopped_reference(tmp_path_factory):
    """The uninterrupted early-stopped run (in this process, as the kill tests' references)."""
    run_dir = str(tmp_path_factory.mktemp("reference"))
    result = train_early_stopped(run_dir)
    assert result.stop_reason.startswith("early stopping")
    return run_dir, result


@pytest.mark.slow
def test_a_requeued_early_stopped_run_trains_nothing_more(early_stopped_reference, tmp_path):
    reference_dir, reference = early_stopped_reference
    run_dir = str(tmp_path / "run")
    first = run_script(run_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    names, metrics, state = CheckpointStore(Storage(run_dir)).names(), read_metrics(run_dir), latest(run_dir).state
    for _ in range(2):  # requeued twice
        again = run_script(run_dir)
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"done: {reference.optimizer_steps} optimizer steps; stopped: early stopping" in again.stdout
    assert CheckpointStore(Storage(run_dir)).names() == names
    assert read_metrics(run_dir) == metrics
    assert all(torch.equal(state["module"][key], value) for key, value in latest(run_dir).state["module"].items())
    assert_same_run(reference_dir, run_dir)


@pytest.mark.slow
def test_sigkill_right_after_the_stopping_commit_resumes_as_finished(early_stopped_reference, tmp_path):
    reference_dir, reference = early_stopped_reference
    stopping_split = latest(reference_dir).progress.records["split.splits"].total.completed
    run_dir = str(tmp_path / "run")
    killed = run_script(run_dir, f"split_end_after_checkpoint:{stopping_split}:sigkill")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_script(run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"done: {reference.optimizer_steps} optimizer steps; stopped: {reference.stop_reason}" in resumed.stdout
    assert_same_run(reference_dir, run_dir)  # parameters, optimizers, progress, metrics.jsonl: torch.equal / bytes
    assert latest(run_dir).progress.end.reason == reference.stop_reason  # the stop is in the checkpoint


def test_a_finished_run_returns_its_result_and_checkpoint(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    _, first = train_validated(run_dir, epochs=3, every_steps=3, callbacks=(early_stopper(),), progress_bar="log")
    _, again = train_validated(run_dir, epochs=3, every_steps=3, callbacks=(early_stopper(),), progress_bar="log")
    assert again.resumed_from == first.last_checkpoint == again.last_checkpoint
    assert (again.optimizer_steps, again.cursor, again.stop_reason) == (first.optimizer_steps, first.cursor,
                                                                       first.stop_reason)
    assert again.progress.end == first.progress.end and first.progress.end.reason == first.stop_reason
    assert "nothing more to train; raise max_epochs, max_steps or max_time to train on" in capsys.readouterr().err


def test_raising_max_epochs_trains_on_and_says_so_on_the_start_line(tmp_path, capsys):
    straight = str(tmp_path / "straight")
    staged = str(tmp_path / "staged")
    train_with_checkpoints("tbptt", straight, epochs=3)
    train_with_checkpoints("tbptt", staged, epochs=2)
    capsys.readouterr()
    result = train_with_checkpoints("tbptt", staged, epochs=3, progress_bar="log")
    assert result.epochs_completed == 3
    assert "the run had finished (max_epochs=2 reached); max_epochs 2 -> 3: training on" in capsys.readouterr().err
    assert_same_run(straight, staged)


def test_raising_max_steps_trains_on_an_early_stopped_run(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    _, first = train_validated(run_dir, epochs=3, every_steps=3, callbacks=(early_stopper(),), max_steps=100)
    _, again = train_validated(run_dir, epochs=3, every_steps=3, callbacks=(early_stopper(),), max_steps=200,
                               progress_bar="log")
    assert again.optimizer_steps > first.optimizer_steps
    assert "max_steps 100 -> 200: training on" in capsys.readouterr().err


class StopAndPreempt(engine.Callback):
    """At the third split, asks to stop and receives SIGTERM in the same split."""

    def __init__(self):
        self.seen = 0

    def on_split_end(self, view):
        self.seen += 1
        if self.seen == 3:
            view.request_stop("enough")
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_preemption_is_not_an_end_but_does_not_erase_a_stop_of_the_same_split(tmp_path):
    preempted_only = str(tmp_path / "preempted")
    signalled = train_with_checkpoints("tbptt", preempted_only, every=4, exit_on_preemption=False,
                                       callbacks=(AtSplit(3, sigterm_to_self),))
    assert signalled.preempted and latest(preempted_only).progress.end is None
    resumed = train_with_checkpoints("tbptt", preempted_only, every=4)
    assert resumed.optimizer_steps > signalled.optimizer_steps and resumed.stop_reason is None

    both = str(tmp_path / "both")
    stopped = train_with_checkpoints("tbptt", both, every=4, exit_on_preemption=False, callbacks=(StopAndPreempt(),))
    assert stopped.preempted and latest(both).progress.end.reason == "enough"
    again = train_with_checkpoints("tbptt", both, every=4)
    assert again.optimizer_steps == stopped.optimizer_steps and again.stop_reason == "enough"


def test_a_checkpoint_without_an_end_record_resumes(tmp_path):
    """Checkpoints of earlier versions hold no "end": they load and the run goes on."""
    straight = str(tmp_path / "straight")
    staged = str(tmp_path / "staged")
    train_with_checkpoints("tbptt", straight, epochs=2)
    train_with_checkpoints("tbptt", staged, epochs=2, max_steps=5)
    strip_end_records(staged)
    assert latest(staged).progress.end is None
    result = train_with_checkpoints("tbptt", staged, epochs=2)
    assert result.resumed_from is not None
    assert_same_run(straight, staged)


def strip_end_records(run_dir):
    """Rewrite every checkpoint's progress.msgpack as an earlier version wrote it (no "end" key),
    fixing the manifest's size and checksum."""
    import json

    import msgpack

    from engine.checkpoint.format.checksum import CRC32C, checksum

    for path in pathlib.Path(run_dir, "checkpoints").iterdir():
        progress_file = path / "progress.msgpack"
        envelope = msgpack.unpackb(progress_file.read_bytes(), raw=False)
        del envelope["tree"]["end"]
        data = msgpack.packb(envelope)
        progress_file.write_bytes(data)
        manifest_path = path / "MANIFEST.json"
        manifest = json.loads(manifest_path.read_text())
        manifest["files"]["progress.msgpack"] = {"size": len(data), CRC32C: checksum([data], CRC32C)}
        manifest_path.write_text(json.dumps(manifest))
