"""Save on exception: an exception (or Ctrl-C) that ends fit commits a checkpoint of the last
completed split when no checkpoint holds it and its state can still be reconstructed exactly;
resuming from it ends bit-identical to a run never interrupted. Where it cannot be
reconstructed exactly (the optimizer already stepped), nothing is written and a note says so."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import tempfile

import pytest

import engine
from engine import faults
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
import forkserver
from kill_helpers import SCRIPT, TIMEOUT, environment, run_scenario
from resume_helpers import assert_same_run
from scenarios import LossRecorder, SeqModel, train_with_checkpoints

EVERY = 10  # splits between the policy's checkpoints (and one at each epoch end)
# "asynchronous": the checkpoint saved before raising is committed before the note names it.
SETUPS = {"no accumulation": {}, "accumulate_grad=4": {"accumulate_grad": 4}, "asynchronous": {"asynchronous": True}}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The uninterrupted run of each setup, with the cursor of every split it completed."""
    cache = {}

    def reference(setup):
        if setup not in cache:
            run_dir = str(tmp_path_factory.mktemp("reference"))
            recorder = LossRecorder()
            train_with_checkpoints("tbptt", run_dir, every=EVERY, callbacks=[recorder], **SETUPS[setup])
            cache[setup] = run_dir, recorder.cursors
        return cache[setup]

    return reference


@pytest.fixture
def armed():
    yield lambda spec: faults.inject(faults.parse_faults(spec))
    faults.clear()


def newest(run_dir):
    return CheckpointStore(Storage(run_dir, create=False), create=False).latest()


def notes(error):
    return "\n".join(getattr(error, "__notes__", []))


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("split", [15, 22])
def test_exception_at_split_k_commits_split_k_minus_1_and_resumes_exactly(tmp_path, references, armed, setup, split):
    reference_dir, cursors = references(setup)
    run_dir = str(tmp_path / "run")
    armed(f"step_start:{split}:raise")  # one optimizer: the k-th step is split k's
    with pytest.raises(engine.InjectedFault) as caught:
        train_with_checkpoints("tbptt", run_dir, every=EVERY, **SETUPS[setup])
    faults.clear()
    saved = newest(run_dir)
    assert saved.progress.cursor.as_tuple() == cursors[split - 2]  # split k-1, which no cadence checkpoint holds
    assert f"saved {saved.name} at" in notes(caught.value)
    result = train_with_checkpoints("tbptt", run_dir, every=EVERY, **SETUPS[setup])
    assert result.resumed_from == saved.name
    assert_same_run(reference_dir, run_dir)


def test_ctrl_c_inside_the_step_commits_the_last_split(tmp_path, references, monkeypatch):
    reference_dir, cursors = references("accumulate_grad=4")
    original = SeqModel.training_step
    calls = []

    def interrupted_at_split_15(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 15:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    run_dir = str(tmp_path / "run")
    with monkeypatch.context() as patch:
        patch.setattr(SeqModel, "training_step", interrupted_at_split_15)
        with pytest.raises(KeyboardInterrupt):
            train_with_checkpoints("tbptt", run_dir, every=EVERY, accumulate_grad=4)
    assert newest(run_dir).progress.cursor.as_tuple() == cursors[13]
    train_with_checkpoints("tbptt", run_dir, every=EVERY, accumulate_grad=4)
    assert_same_run(reference_dir, run_dir)


def test_exception_after_the_optimizer_stepped_writes_nothing_and_says_why(tmp_path, references, armed):
    reference_dir, cursors = references("no accumulation")
    run_dir = str(tmp_path / "run")
    armed("after_optimizer_step:15:raise")
    with pytest.raises(engine.InjectedFault) as caught:
        train_with_checkpoints("tbptt", run_dir, every=EVERY)
    faults.clear()
    assert cursors.index(newest(run_dir).progress.cursor.as_tuple()) < 13  # the policy's, none at split 14
    assert "cannot be reconstructed exactly, an optimizer step started since" in notes(caught.value)
    train_with_checkpoints("tbptt", run_dir, every=EVERY)
    assert_same_run(reference_dir, run_dir)


def test_save_on_exception_false_writes_nothing(tmp_path, references, armed):
    _, cursors = references("no accumulation")
    run_dir = str(tmp_path / "run")
    armed("step_start:15:raise")
    with pytest.raises(engine.InjectedFault):
        train_with_checkpoints("tbptt", run_dir, every=EVERY, save_on_exception=False)
    assert cursors.index(newest(run_dir).progress.cursor.as_tuple()) < 13


def test_exception_after_backward_into_an_open_window_writes_nothing_and_says_why(tmp_path, references, armed):
    """accumulate_grad=4: split 15's backward adds to the gradients split 13 and 14 left pending,
    so split 14's state is gone (the record sees the gradients written in place)."""
    reference_dir, cursors = references("accumulate_grad=4")
    run_dir = str(tmp_path / "run")
    armed("after_backward:15:raise")
    with pytest.raises(engine.InjectedFault) as caught:
        train_with_checkpoints("tbptt", run_dir, every=EVERY, accumulate_grad=4)
    faults.clear()
    assert cursors.index(newest(run_dir).progress.cursor.as_tuple()) < 13
    assert "a parameter, buffer, gradient or hidden state was written in place" in notes(caught.value)
    train_with_checkpoints("tbptt", run_dir, every=EVERY, accumulate_grad=4)
    assert_same_run(reference_dir, run_dir)


def ctrl_c_at_random_instant(run_dir, rng, max_delay):
    """Start scenarios.py, wait until it trains, send SIGINT after a random delay; its status."""
    with tempfile.TemporaryFile(mode="w+") as stderr:
        # 0.03 s after each of the 24 splits: a first run lasts longer than the longest delay.
        process = forkserver.popen([sys.executable, SCRIPT, "tbptt", run_dir, "--every", str(EVERY), "--sleep", "0.03"],
                                   env=environment(None), stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            if process.stdout.readline().startswith("training"):
                signal_at = rng.uniform(0.0, max_delay)
                try:
                    process.wait(signal_at)
                except subprocess.TimeoutExpired:
                    process.send_signal(signal.SIGINT)
            process.wait(TIMEOUT)
            stderr.seek(0)
            return process.returncode, stderr.read()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            process.stdout.close()


@pytest.mark.slow
def test_ctrl_c_at_random_instants_resumes_exactly(tmp_path, references):
    """A real SIGINT anywhere (in a step, a boundary record, a checkpoint write): whether the last
    split was saved or not, the run resumed to its end is bit-identical."""
    reference_dir, _ = references("no accumulation")
    run_dir = str(tmp_path / "run")
    rng = random.Random("ctrl-c")
    interrupted = 0
    for _ in range(4):
        status, stderr = ctrl_c_at_random_instant(run_dir, rng, 0.6)
        assert status in (0, -signal.SIGINT), stderr[-3000:]
        interrupted += status == -signal.SIGINT
    assert interrupted >= 1
    finished = run_scenario("tbptt", run_dir, None, "--every", str(EVERY))
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert_same_run(reference_dir, run_dir)
