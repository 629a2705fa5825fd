"""SIGTERM at random instants during the demo (real processes): each one exits by itself with
the documented code, its checkpoint names the last completed split, and each run finished by
resuming has the fingerprint and metrics of the uninterrupted one."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

import forkserver
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from progress import Cursor

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EPOCHS = "4"
DEMO = [sys.executable, "-m", "engine", "demo", "--epochs", EPOCHS, "--checkpoint-every", "5", "--progress", "off"]
FINAL_CURSOR = Cursor(int(EPOCHS) - 1, 5, 3, 0)  # 6 windows x 4 splits per epoch
HANG_GUARD = 120  # seconds; a guard against a hang, not a timing assertion


def environment():
    env = dict(os.environ)
    env.pop("SPLITLOOP_FAULTS", None)
    env["OMP_NUM_THREADS"] = "1"  # a tiny model: threads only contend on a loaded machine
    return env


def fingerprint(output):
    return output.strip().splitlines()[-1].split("fingerprint: ")[1]


def newest_checkpoint(run_dir):
    directory = os.path.join(run_dir, "checkpoints")
    names = sorted(n for n in os.listdir(directory) if n.startswith("ckpt-")) if os.path.isdir(directory) else []
    return names[-1] if names else None


def wait_for_new_checkpoint(run_dir, process, before):
    """Training is under way once this process committed a checkpoint of its own."""
    while process.poll() is None:
        if newest_checkpoint(run_dir) != before:
            return True
        time.sleep(0.01)
    return False


def preempt_until_finished(run_dir, rng):
    """SIGTERM the demo at random instants until a start finishes by itself; returns the
    number of preemptions and the finishing output."""
    preemptions = 0
    while True:
        before = newest_checkpoint(run_dir)
        process = forkserver.popen(DEMO + ["--dir", run_dir], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=environment())
        if wait_for_new_checkpoint(run_dir, process, before):
            time.sleep(rng.uniform(0.0, 0.6))
            process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=HANG_GUARD)
        if process.returncode == 0:
            return preemptions, stdout
        latest = CheckpointStore(Storage(run_dir)).latest()
        if process.returncode == -signal.SIGTERM:
            # The signal came after fit had returned (handlers restored): the work was done.
            assert latest.progress.cursor == FINAL_CURSOR and latest.progress.records["fit.epochs"].total.completed == int(EPOCHS)
            continue
        assert process.returncode == 75, stderr[-3000:]
        preemptions += 1
        with open(os.path.join(run_dir, "metrics.jsonl")) as metrics:
            last = json.loads(metrics.read().splitlines()[-1])
        assert latest.progress.cursor == Cursor(last["epoch"], last["batch"], last["split"], 0)


@pytest.mark.exhaustive  # CI time (about 16 s: the default run keeps the other preemption tests of tests/run)
def test_sigterm_at_random_instants_of_the_demo(tmp_path):
    reference_dir = str(tmp_path / "reference")
    reference = forkserver.run(DEMO + ["--dir", reference_dir], capture_output=True, text=True,
                               env=environment(), timeout=HANG_GUARD)
    assert reference.returncode == 0, reference.stderr
    with open(os.path.join(reference_dir, "metrics.jsonl"), "rb") as metrics:
        reference_metrics = metrics.read()
    rng = random.Random(75)
    total = 0
    runs = 0
    while total < 10:
        run_dir = str(tmp_path / f"run{runs}")
        runs += 1
        preemptions, output = preempt_until_finished(run_dir, rng)
        total += preemptions
        assert fingerprint(output) == fingerprint(reference.stdout)
        with open(os.path.join(run_dir, "metrics.jsonl"), "rb") as metrics:
            assert metrics.read() == reference_metrics
    assert total >= 10
